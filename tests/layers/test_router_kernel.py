"""The native router (`specmoe.kernels.router`): softmax top-k routing and the shared-expert
gate's sigmoid, which the modules and the fused decoder driver both call. It follows the tie
rule (equal weights: the lower expert id wins and comes first) and gives the plain-torch
reference's bits where torch runs its AVX-512 kernels (within a few fp32 ulps elsewhere)."""

from __future__ import annotations

import pytest
import torch

from specmoe.kernels import router
from specmoe.layers.moe.router import TopKRouter

KERNEL_UNAVAILABLE_REASON = router.kernel_unavailable_reason  # for `enabled`
BF16 = torch.bfloat16
TORCH_AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"


def _reference(logits: torch.Tensor, k: int, norm: bool):
    r = TopKRouter(8, logits.shape[1], k, norm)
    out = r.route_reference(logits, BF16)
    return out.topk_ids, out.topk_weights


def _assert_matches(logits, k, norm):
    ids, weights = router.try_route_softmax_bf16(logits, k, norm)
    ref_ids, ref_weights = _reference(logits, k, norm)
    assert torch.equal(ids, ref_ids)
    if TORCH_AVX512:
        assert torch.equal(weights, ref_weights)
    else:  # torch's other vector widths sum in another order
        torch.testing.assert_close(weights, ref_weights, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("n", [3, 8, 15, 16, 17, 32, 60, 64, 100, 128, 256])
@pytest.mark.parametrize("k", [1, 2, 4, 6, 8, 9, 15, 16, 17, 31, 33, 40, 64])
@pytest.mark.parametrize("norm", [False, True])
def test_routing_has_the_torch_reference_bits(enabled, n, k, norm):
    if k > n:
        pytest.skip("k > N")
    g = torch.Generator().manual_seed(n * 100 + k)
    for scale in (0.05, 1.0, 8.0, 40.0):
        logits = (torch.randn(37, n, generator=g) * scale).to(BF16)
        _assert_matches(logits, k, norm)
        _assert_matches(logits[:1], k, norm)  # torch may reduce a single row otherwise


@pytest.mark.skipif(not TORCH_AVX512, reason="torch sums in another order on this CPU")
def test_renormalising_sum_has_torch_sum_bits(enabled):
    """The top-k renormalisation divides by the sum of the k weights: summed in ATen's order
    for every k the kernel takes (the bf16 weights hide most one-ulp differences of the sum,
    so this checks the float32 sum itself)."""
    import ctypes
    fn = router.library().specmoe_router_row_sum
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_void_p, ctypes.c_int64]
    g = torch.Generator().manual_seed(0)
    for n in range(1, router.MAX_TOP_K + 1):
        rows = torch.rand(64, n, generator=g) * torch.rand(64, 1, generator=g) ** 8
        expected = rows.sum(dim=-1)
        got = torch.tensor([fn(r.data_ptr(), n) for r in rows])
        assert torch.equal(got, expected), f"k={n}"


def test_ties_go_to_the_lower_expert_id(enabled):
    n, k = 32, 4
    logits = torch.zeros(3, n, dtype=BF16)  # row 0: all equal
    logits[1, [5, 9, 20, 30, 31]] = 1.0  # row 1: five-way tie for four places
    logits[2, [7, 3]] = 2.0  # row 2: a tie on top, then a tie among the rest
    ids, weights = router.try_route_softmax_bf16(logits, k, False)
    assert ids.tolist() == [[0, 1, 2, 3], [5, 9, 20, 30], [3, 7, 0, 1]]
    assert torch.equal(weights[0], torch.full((k,), 1 / n, dtype=BF16))
    _assert_matches(logits, k, False)
    _assert_matches(logits, k, True)


def test_the_router_module_routes_through_the_kernel(enabled, monkeypatch):
    calls = []
    real = router.try_route_softmax_bf16
    monkeypatch.setattr("specmoe.layers.moe.router.try_route_softmax_bf16",
                        lambda *a: calls.append(1) or real(*a))
    r = TopKRouter(64, 16, 4, True).to(BF16)
    with torch.no_grad():  # Linear leaves its weight uninitialised (the loader fills it)
        r.gate.weight.copy_(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(5, 64).to(BF16)
    with torch.no_grad():
        out, ref = r(x), r.forward_reference(x)
    assert calls == [1] and torch.equal(out.topk_ids, ref.topk_ids)
    torch.testing.assert_close(out.topk_weights, ref.topk_weights, atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 100, 128, 200])
def test_sigmoid_has_torch_bits(enabled, n):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 6).to(BF16)
    x[0] = 0.0
    out, ref = router.sigmoid_bf16(x), torch.sigmoid(x)
    if TORCH_AVX512:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, atol=0, rtol=2 ** -7)
