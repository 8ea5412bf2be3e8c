"""The native bf16 linear kernel agrees with F.linear in fp32, and falls back where it must."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specmoe import kernels
from specmoe.kernels import gemv
from specmoe.layers.embed_head import TiedProjection, VocabEmbedding
from specmoe.layers.linear import Linear, linear

# (in_features, out_features): K tails (not a multiple of 32), odd and tiny outputs, and
# Qwen2.5-1.5B-like widths.
SHAPES = [(1, 7), (31, 3), (32, 1), (33, 5), (100, 37), (200, 19), (64, 129), (1536, 2048),
          (8960, 50)]


KERNEL_UNAVAILABLE_REASON = kernels.kernel_unavailable_reason  # for the `enabled` fixture


def _inputs(t: int, k: int, n: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).bfloat16()  # [T, in]
    w = torch.randn(n, k, generator=g).bfloat16()  # [out, in]
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


def _assert_matches_fp32(y: torch.Tensor, x, w, b) -> None:
    """y (bf16) against the fp32 reference: within bf16 rounding of the output (one ulp
    relative, 2^-8) plus fp32 summation-order noise."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-3 * x.shape[-1] ** 0.5)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_fp32_reference(enabled, k, n, bias):
    for t in [*range(1, 17), 17, 40, 97]:  # decode and verification sizes, then blocks of 96
        x, w, b = _inputs(t, k, n, bias, seed=t)
        y = kernels.try_linear_bf16(x, w, b)
        assert y is not None, f"T={t} took the fallback"
        _assert_matches_fp32(y, x, w, b)


def test_fma_variant_matches_reference(enabled, fma_variant):
    """The build without AVX512-BF16 (shift + FMA) agrees too."""
    kernel = fma_variant(gemv.load_kernel)
    assert kernel.library.specmoe_gemv_isa() == 1
    for t in (1, 5, 9, 16, 100):
        x, w, b = _inputs(t, 200, 37, bias=True, seed=t)
        y = gemv.run_kernel(kernel, x, gemv.pack_weight_reference(w), w.shape[0], b)
        _assert_matches_fp32(y, x, w, b)


def test_leading_dims_and_thread_counts(enabled):
    """Work split among the threads asked for (1-3; work this small runs on at most 2), and
    x with leading dimensions."""
    was = torch.get_num_threads()
    try:
        for t, threads in [(1, 1), (1, 2), (6, 1), (6, 2), (6, 3), (50, 2)]:
            x, w, b = _inputs(t, 1001, 301, bias=True)
            torch.set_num_threads(threads)
            y = kernels.try_linear_bf16(x.view(1, t, 1001), w, b)  # [1, T, out]
            assert y.shape == (1, t, 301)
            _assert_matches_fp32(y.view(t, 301), x, w, b)
    finally:
        torch.set_num_threads(was)


def test_threads_share_a_panel_by_row_groups(enabled):
    """Threads whose shares meet inside a panel split it by row groups (9 panels, SmolLM2's
    576 outputs, shared at 2, 4 and 5 threads; 3 panels; one panel shared by all threads):
    every output is written, with the bits of its row alone. The output starts as NaN, so
    a row no thread wrote shows."""
    kernel = gemv._lazy.get()
    was = torch.get_num_threads()
    try:
        for n in (576, 130, 40):  # 9, 3 and 1 panels
            x, w, b = _inputs(200, 1152, n, bias=True, seed=n)
            packed = gemv.pack_weight(w)
            torch.set_num_threads(1)
            alone = torch.cat([kernels.try_linear_bf16(x[i:i + 1], w, b) for i in range(200)])
            for threads in (2, 4, 5):
                for t in (7, 11, 16, 40, 97, 200):
                    y = torch.full((t, n), float("nan"), dtype=torch.bfloat16)
                    kernel(x.data_ptr(), packed.data_ptr(), b.data_ptr(), y.data_ptr(), t,
                           1152, n, threads)
                    assert torch.equal(y, alone[:t]), (n, threads, t)
    finally:
        torch.set_num_threads(was)


@pytest.mark.parametrize("k,n", [(1536, 2048), (8960, 96), (1001, 301), (100, 37)])
def test_rows_are_batch_invariant_bit_for_bit(enabled, k, n):
    """Row i of a T-row call has the bits of the same row alone, for every T <= 16 and for
    prefill sizes (all code paths: one pass over a panel for up to 6 rows, slices with
    accumulators set aside beyond, blocks of 96 rows), any position, on 1 and 2 threads:
    what keeps bf16 greedy speculative decoding equal to plain decoding, with chunked
    prefills and prefix-cache hits too."""
    num = 200
    x, w, b = _inputs(num, k, n, bias=True, seed=k)
    was = torch.get_num_threads()
    try:
        alone = torch.cat([kernels.try_linear_bf16(x[i:i + 1], w, b) for i in range(num)])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for t in [*range(1, 17), 23, 97, num]:
                for start in {0, num - t, (num - t) // 3}:
                    y = kernels.try_linear_bf16(x[start:start + t].contiguous(), w, b)
                    assert torch.equal(y, alone[start:start + t]), (t, start, threads)
    finally:
        torch.set_num_threads(was)


def test_fallback_for_unsupported_inputs(enabled):
    x, w, b = _inputs(4, 64, 16, bias=True)
    cases = {
        "float32": (x.float(), w.float(), b.float()),
        "float32 bias": (x, w, b.float()),
        "no rows": (x[:0], w, None),
        "non-contiguous x": (x.t().contiguous().t(), w, None),
        "non-contiguous weight": (x, torch.cat([w, w], 1)[:, ::2], None),
        "shape mismatch": (x[:, :32], w, None),
    }
    for name, (xi, wi, bi) in cases.items():
        assert kernels.try_linear_bf16(xi, wi, bi) is None, name
    with torch.enable_grad():
        assert kernels.try_linear_bf16(x, w.requires_grad_(), b) is None
    w.requires_grad_(False)
    kernels.set_enabled(False)
    assert kernels.try_linear_bf16(x, w, b) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_take_f_linear(enabled):
    x, w, b = (t.cuda() for t in _inputs(2, 64, 16, bias=True))
    assert kernels.try_linear_bf16(x, w, b) is None
    assert linear(x, w, b).device.type == "cuda"


def test_linear_and_tied_head_route_through_kernel(enabled):
    torch.manual_seed(0)
    layer = Linear(96, [40, 24], bias=True).bfloat16()
    torch.nn.init.normal_(layer.weight), torch.nn.init.normal_(layer.bias)
    emb = VocabEmbedding(50, 96).bfloat16()
    torch.nn.init.normal_(emb.weight)
    head = TiedProjection(emb)
    x = torch.randn(5, 96).bfloat16()
    with torch.inference_mode():
        _assert_matches_fp32(layer(x), x, layer.weight, layer.bias)
        _assert_matches_fp32(head(x), x, emb.weight, None)
        kernels.set_enabled(False)
        assert torch.equal(layer(x), layer.forward_reference(x))
        assert torch.equal(head(x), F.linear(x, emb.weight))


def test_one_openmp_runtime(enabled):
    """The kernel shares torch's libgomp (no second thread pool)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(paths) <= 1, paths
