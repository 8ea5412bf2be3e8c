"""The fused int4 MoE kernel (`specmoe.kernels.moe_int4`) and `QuantizedRoutedExperts.forward`
on it: bit for bit the per-expert int4 loop (`forward_loop`) and the composition of the
native kernels it fuses (both ISA builds), within rounding of the plain-torch reference,
batch-invariant at any rows per expert, thread-count invariant, clear errors on bad input
(nothing written), and through a quantised MoE block with a shared expert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import (check_batch_invariance, check_routing_errors, int4_batch_invariant,
                           poison_moe_scratch, require_kernel, same_bits)

from specmoe.config import MoEConfig
from specmoe.kernels import elementwise, gemv_int4, moe_int4
from specmoe.layers.linear import Linear
from specmoe.layers.moe.block import SparseMoEBlock
from specmoe.layers.quantization import (Int4Linear, QuantizedRoutedExperts,
                                         quantize_model)
from tiny_models import random_bf16_experts, random_routing

KERNEL_UNAVAILABLE_REASON = moe_int4.kernel_unavailable_reason  # for the `enabled` fixture
U = 2.0 ** -8  # bf16 unit roundoff
BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _quantized(n: int, h: int, i: int, seed: int = 0) -> QuantizedRoutedExperts:
    qe = QuantizedRoutedExperts.from_experts(random_bf16_experts(n, h, i, seed=seed), "int4")
    assert qe.method == "int4"
    return qe


def _one_call(qe: QuantizedRoutedExperts, x, ids, weights, num_threads=None) -> torch.Tensor:
    out = moe_int4.try_moe_int4(x, ids, weights, qe._fused_experts(), num_threads)
    assert out is not None, "the fused int4 kernel did not apply"
    return out


@pytest.fixture
def natives(enabled):
    """The fused kernel, and the int4 linear and elementwise kernels of the loop."""
    require_kernel("int4 linear kernel", gemv_int4.kernel_unavailable_reason())
    require_kernel("elementwise kernels", elementwise._lazy.unavailable_reason())


@pytest.fixture
def batch_invariant():
    """gemv_int4's batch-invariant mode: the loop then runs the int4 kernel at any rows."""
    with int4_batch_invariant():
        yield


def _int4_linear(kernel, view: gemv_int4.Int4Weights, x: torch.Tensor) -> torch.Tensor:
    """x [n, in] through one int4 kernel build, in calls of at most MAX_ROWS rows."""
    if x.shape[0] <= gemv_int4.MAX_ROWS:
        return gemv_int4.run_kernel(kernel, view, x)
    return gemv_int4._split_rows(kernel, view, x)


def _composition(qe: QuantizedRoutedExperts, x, ids, weights, linear_kernel) -> torch.Tensor:
    """The native kernels one call each: per active expert the int4 linear kernel on its
    rows, the native SiLU-and-mul, the int4 kernel again; then per token
    acc = w[0] * y[0], acc = acc + w[s] * y[s] for s = 1 .. k-1 in fp32, rounded once."""
    w13, w2 = qe._kernel_views()
    (t, h), k = x.shape, ids.shape[1]
    y = torch.empty(t, k, h, dtype=BF16)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        act = elementwise.try_silu_and_mul_bf16(_int4_linear(linear_kernel, w13[e],
                                                             x[rows].contiguous()))
        assert act is not None
        y[rows, slots] = _int4_linear(linear_kernel, w2[e], act)
    acc = weights[:, :1].float() * y[:, 0].float()
    for s in range(1, k):
        acc = acc + weights[:, s:s + 1].float() * y[:, s].float()
    return acc.to(BF16)


# (N, H, I, k): N up to 256, k up to 8; H and I multiples of 32 (the int4 groups), H with
# a partial 16-row unit of down rows and 2I with odd blocks of 4 groups
SHAPES = [(8, 64, 32, 2), (64, 64, 32, 8), (256, 32, 32, 8), (16, 96, 64, 4), (8, 160, 96, 1)]
TOKENS = (1, 2, 5, 9, 17, 80, 320)


@pytest.mark.parametrize("n,h,i,k", SHAPES)
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
def test_one_call_has_the_bits_of_the_per_expert_loop(natives, batch_invariant, n, h, i, k,
                                                      skewed):
    """In batch-invariant mode the loop runs the int4 kernel at any rows per expert, so the
    one call must give its bits at every T (skewed: experts with up to ~320 rows, many
    tiles of 16)."""
    qe = _quantized(n, h, i, seed=n + h)
    gen = torch.Generator().manual_seed(n * k + skewed)
    for t in TOKENS:
        x = torch.randn(t, h, generator=gen).to(BF16)
        dtype = BF16 if t % 2 else torch.float32  # the router's bf16, or fp32
        ids, weights = random_routing(t, n, k, gen, skewed, dtype)
        poison_moe_scratch()
        out = _one_call(qe, x, ids, weights)
        assert out.shape == (t, h) and out.dtype is BF16
        assert same_bits(out, qe.forward_loop(x, ids, weights)), f"T={t}"


def test_default_mode_loop_bits_up_to_32_rows_per_expert(natives):
    """Without batch-invariant mode the loop runs the int4 kernel while no expert has more
    than MAX_SPLIT_ROWS rows: there too the same bits."""
    assert not gemv_int4.is_batch_invariant()
    n, h, i, k = 64, 96, 64, 8
    qe = _quantized(n, h, i, seed=1)
    gen = torch.Generator().manual_seed(1)
    for t, skewed in [(1, False), (4, True), (16, True), (32, True), (100, False)]:
        x = torch.randn(t, h, generator=gen).to(BF16)
        ids, weights = random_routing(t, n, k, gen, skewed, BF16)
        assert int(torch.bincount(ids.flatten()).max()) <= gemv_int4.MAX_SPLIT_ROWS
        assert same_bits(_one_call(qe, x, ids, weights), qe.forward_loop(x, ids, weights))


def test_one_expert_with_many_rows_and_repeated_ids(natives, batch_invariant):
    """320 tokens on one expert (20 tiles of 16 rows sharing its weight blocks), and
    repeated ids within a token (each slot counted)."""
    qe = _quantized(4, 64, 64, seed=2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(320, 64, generator=gen).to(BF16)
    for ids in (torch.full((320, 1), 3), torch.tensor([[2, 2, 0]] * 320)):
        weights = torch.rand(*ids.shape, generator=gen)
        out = _one_call(qe, x, ids, weights)
        assert same_bits(out, qe.forward_loop(x, ids, weights))


def _sum_error(qe: QuantizedRoutedExperts, which: str, e: int, a: torch.Tensor
               ) -> torch.Tensor:
    """A bound on the fp32 error of a [n, in] @ W^T for expert e's `which` weight, as the
    int4 kernel sums it or as F.linear does, before the output's bf16 rounding.

    The kernel sums the exact products a_i (128 + q_i) (at most 143 |a_i|), 8 to a lane of
    a block of 128 inputs (at most 6 roundings, with the scale's FMA), the blocks into two
    accumulators (ceil(NB / 2) more), the zero terms (z - 136 s) sum(a) of 16 groups at a
    time onto one of them (ceil(in / 512) more, and one for z - 136 s), then the two
    accumulators and a 4-level tree (5 more): each rounding errs by at most 2^-24 of a
    partial sum, itself at most sum_i |a_i| (279 s_i + |z_i|) with s_i, z_i the scale and
    zero of input i's group. F.linear's sum of a_i W_i errs by at most in 2^-24 |a| . |W|.
    """
    num_in = a.shape[1]
    chain = 12 + -(-num_in // 256) + -(-num_in // 512)
    scales = getattr(qe, f"{which}_scales")[e].float().repeat_interleave(32, dim=-1)
    zeros = getattr(qe, f"{which}_zeros")[e].float().abs().repeat_interleave(32, dim=-1)
    w = qe.dequantized(which, e).abs()
    kernel = chain * 2.0 ** -24 * F.linear(a.abs(), 279 * scales + zeros)
    return torch.maximum(kernel, num_in * 2.0 ** -24 * F.linear(a.abs(), w))


def _rounding_bound(qe: QuantizedRoutedExperts, x, ids, weights) -> torch.Tensor:
    """First-order bound on |one call - forward_reference| per output before their final
    rounding (added by the caller), both computed from the same dequantised weights with
    every bf16 rounding erring by at most U relative: on each side gate/up are within
    U |gu| (rounding) + the fp32 sum error (`_sum_error`) of the exact values; the SiLU's
    slope stays below 1.1, so silu(g) * up moves by 1.1 dg |up| + |silu(g)| dup; silu(g)
    rounded (the kernel only), the product rounded (both sides); the down output differs
    by |W2| . (that) plus each side's rounding and fp32 sum error; the weighted fp32 slot
    sums are the same operations on those outputs, adding w |dy|."""
    t, k = ids.shape
    inter = qe.intermediate_size
    xf = x.float()
    bound = torch.zeros(t, x.shape[1])
    for s in range(k):
        for e in ids[:, s].unique().tolist():
            rows = (ids[:, s] == e).nonzero().flatten()
            w13, w2 = qe.dequantized("w13", e), qe.dequantized("w2", e)
            gu = F.linear(xf[rows], w13)
            e_gu = 2 * (U * gu.abs() + _sum_error(qe, "w13", e, xf[rows]))
            g, up = gu[:, :inter], gu[:, inter:]
            act = F.silu(g) * up
            e_act = (1.1 * e_gu[:, :inter] * up.abs() + F.silu(g).abs() * e_gu[:, inter:]
                     + 3 * U * act.abs())
            y = F.linear(act, w2)
            e_y = F.linear(e_act, w2.abs()) + 2 * (U * y.abs() + _sum_error(qe, "w2", e, act))
            bound[rows] += weights[rows, s:s + 1].float().abs() * e_y
    return bound


@pytest.mark.parametrize("n,h,i,k", [(8, 64, 32, 2), (64, 128, 64, 8), (256, 32, 32, 4)])
def test_within_rounding_of_the_reference(natives, n, h, i, k):
    qe = _quantized(n, h, i, seed=3)
    gen = torch.Generator().manual_seed(4)
    for t, skewed in [(1, False), (9, True), (80, False), (320, True)]:
        x = torch.randn(t, h, generator=gen).to(BF16)
        ids, weights = random_routing(t, n, k, gen, skewed)
        out = _one_call(qe, x, ids, weights).float()
        ref = qe.forward_reference(x, ids, weights).float()
        bound = _rounding_bound(qe, x, ids, weights) + U * (out.abs() + ref.abs()) + 1e-6
        err = (out - ref).abs()
        assert (err <= 1.25 * bound).all(), f"T={t}: worst {(err / bound).max():.2f} of bound"


def test_batch_invariance_at_any_rows_per_expert(natives):
    """Each token's bits are the same alone (T = 1) as among 2..80 tokens, at any position,
    in the default mode, with experts 0 and 1 getting up to ~72 rows (where the dense int4
    layers and the loop change their order of sums)."""
    assert not gemv_int4.is_batch_invariant()
    n, h, i, k = 64, 96, 64, 8
    qe = _quantized(n, h, i, seed=5)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(80, h, generator=gen).to(BF16)
    ids, weights = random_routing(80, n, k, gen, skewed=True, dtype=BF16)
    check_batch_invariance(lambda *args: _one_call(qe, *args), x, ids, weights,
                           (2, 3, 9, 16, 17, 33, 40, 79, 80), gen)


def test_thread_count_invariance(natives):
    """1 and 2 threads give the same bits, on a layer big enough that 2 threads do run
    (a decode step's one row per expert included; skewed: an expert's rows split between
    the threads)."""
    n, h, i, k = 64, 256, 128, 8
    qe = _quantized(n, h, i, seed=6)
    experts = qe._fused_experts()
    kernel = moe_int4._lazy.get()
    gen = torch.Generator().manual_seed(6)
    for t, skewed in [(1, False), (2, False), (9, True), (40, False), (100, True)]:
        x = torch.randn(t, h, generator=gen).to(BF16)
        ids, weights = random_routing(t, n, k, gen, skewed)
        poison_moe_scratch()
        one, used_one = moe_int4.run_kernel(kernel, x, ids, weights, experts, num_threads=1)
        poison_moe_scratch()
        two, used_two = moe_int4.run_kernel(kernel, x, ids, weights, experts, num_threads=2)
        assert used_one == 1 and used_two == 2, (t, used_two)
        assert same_bits(one, two), f"T={t}"
        assert same_bits(one, _composition(qe, x, ids, weights, gemv_int4._lazy.get()))


def test_fma_variant_bit_exact_with_its_composition(natives, fma_variant):
    """The build without AVX512-BF16 (shift + FMA) matches the int4 linear kernel's FMA
    build, one call each."""
    kernel, linear_kernel = fma_variant(moe_int4.load_kernel), fma_variant(gemv_int4.load_kernel)
    assert kernel.library.specmoe_moe_int4_isa() == 1
    assert linear_kernel.library.specmoe_gemv_int4_isa() == 1
    qe = _quantized(16, 64, 64, seed=7)
    gen = torch.Generator().manual_seed(7)
    for t in (1, 9, 40):
        x = torch.randn(t, 64, generator=gen).to(BF16)
        ids, weights = random_routing(t, 16, 4, gen, skewed=t == 40)
        out, _ = moe_int4.run_kernel(kernel, x, ids, weights, qe._fused_experts())
        assert same_bits(out, _composition(qe, x, ids, weights, linear_kernel))


def test_no_tokens_and_where_it_does_not_apply(natives, kernels_off):
    qe = _quantized(8, 64, 32)
    experts = qe._fused_experts()
    out = _one_call(qe, torch.zeros(0, 64, dtype=BF16), torch.zeros(0, 2, dtype=torch.long),
                    torch.zeros(0, 2))
    assert out.shape == (0, 64) and out.dtype is BF16
    x = torch.randn(3, 64).to(BF16)
    ids, w = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.rand(3, 2)
    assert moe_int4.try_moe_int4(x.float(), ids, w, experts) is None
    assert moe_int4.try_moe_int4(x.requires_grad_(), ids, w, experts) is None
    with kernels_off():
        assert moe_int4.try_moe_int4(x.detach(), ids, w, experts) is None


def test_bad_inputs_raise_value_error_and_write_nothing(natives):
    n, h, i = 8, 64, 32
    qe = _quantized(n, h, i)
    experts = qe._fused_experts()
    x = torch.randn(3, h).to(BF16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    w = torch.rand(3, 2)
    check_routing_errors(lambda *args: moe_int4.try_moe_int4(*args, experts), x, ids, w, n,
                         torch.randn(3, h + 32).to(BF16))
    for bad in (n, -1, 1000):
        wrong = ids.clone()
        wrong[1, 1] = bad
        # the kernel itself: refused before anything is written
        out = torch.full((3, h), 7.0, dtype=BF16)
        scratch = moe_int4.scratch_for(3, 2, h, i, n)
        rc = moe_int4._lazy.get()(x.data_ptr(), wrong.data_ptr(), w.data_ptr(), 0,
                                  experts.w13, experts.w2, out.data_ptr(), scratch.data_ptr(),
                                  3, 2, h, i, n, 2)
        assert rc == -2 and bool((out == 7).all())
    bufs = [getattr(qe, name) for name in ("w13_packed", "w13_scales", "w13_zeros",
                                           "w2_packed", "w2_scales", "w2_zeros")]
    with pytest.raises(ValueError, match=r"w2_scales must be \[8, 64, 1\]"):
        moe_int4.Int4Experts(*bufs[:4], bufs[4][:, :, :0], bufs[5])
    with pytest.raises(ValueError, match="w13_zeros must be"):
        moe_int4.Int4Experts(*bufs[:2], bufs[2].float(), *bufs[3:])
    with pytest.raises(ValueError, match="multiples of 32"):
        moe_int4.Int4Experts(bufs[0][:, :, :8], *bufs[1:])


# ---- QuantizedRoutedExperts and a quantised MoE block ------------------------------------


def test_forward_is_the_one_call(natives, monkeypatch):
    qe = _quantized(16, 64, 64, seed=8)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(12, 64, generator=gen).to(BF16)
    ids, weights = random_routing(12, 16, 4, gen, dtype=BF16)
    calls = []
    real = moe_int4.run_kernel
    monkeypatch.setattr(moe_int4, "run_kernel",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = qe(x, ids, weights)
    assert calls == [1]
    assert same_bits(out, _one_call(qe, x, ids, weights))
    # the buffers moved (as into huge pages): the kernel follows them
    for name in ("w13_packed", "w2_zeros"):
        setattr(qe, name, getattr(qe, name).clone())
    assert same_bits(qe(x, ids, weights), out)
    assert qe._fused_experts().tensors[0] is qe.w13_packed


def _moe_block(h: int = 128, n: int = 16, i: int = 64, k: int = 4, shared: int = 64,
               seed: int = 9) -> torch.nn.ModuleList:
    """One Qwen2-MoE-style block (router, routed experts, shared expert with its sigmoid
    gate) with random weights, quantised by `quantize_model`."""
    block = SparseMoEBlock(h, MoEConfig(num_experts=n, top_k=k, moe_intermediate_size=i,
                                        norm_topk_prob=False,
                                        shared_expert_intermediate_size=shared,
                                        has_shared_expert_gate=True), 0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    model = torch.nn.ModuleList([block]).to(BF16).requires_grad_(False)
    assert quantize_model(model, "int4") == 3  # shared gate/up and down, experts
    return model


def test_quantised_block_with_a_shared_expert(natives, batch_invariant, monkeypatch):
    """After `quantize_model(.., "int4")` the block's routed experts run the one call (the
    shared expert its int4 layers) with the bits of the per-expert loop, and the block's
    output is within rounding of the reference experts'."""
    block = _moe_block()[0]
    assert isinstance(block.experts, QuantizedRoutedExperts)
    assert isinstance(block.shared_expert.gate_up_proj, Int4Linear)
    assert type(block.router.gate) is Linear and type(block.shared_expert_gate) is Linear
    calls = []
    real = moe_int4.run_kernel
    monkeypatch.setattr(moe_int4, "run_kernel",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    gen = torch.Generator().manual_seed(10)
    for t in (1, 7, 80):
        x = torch.randn(t, 128, generator=gen).to(BF16)
        block.run_experts = block.experts.forward
        out = block(x)
        assert calls and out.shape == (t, 128) and out.dtype is BF16
        block.run_experts = block.experts.forward_loop
        assert same_bits(out, block(x)), f"T={t}"
        block.run_experts = block.experts.forward_reference
        ref = block(x).float()
        routing = block.router(x)
        ids, weights = routing.topk_ids, routing.topk_weights
        routed = block.experts(x, ids, weights).float()
        routed_ref = block.experts.forward_reference(x, ids, weights).float()
        # the routed outputs' bound and final roundings, then each side's sum with the
        # shared expert's output, rounded
        bound = (_rounding_bound(block.experts, x, ids, weights)
                 + U * (routed.abs() + routed_ref.abs() + out.float().abs() + ref.abs()) + 1e-6)
        err = (out.float() - ref).abs()
        assert (err <= 1.25 * bound).all(), f"T={t}: worst {(err / bound).max():.2f} of bound"
