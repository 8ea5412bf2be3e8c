"""The fused native MoE kernel (`specmoe.kernels.moe`): bit for bit the composition of the
native kernels it fuses, within bf16 rounding of the fp32 per-token reference, batch and
thread-count invariant, clear errors on bad input, and the "fused" backend."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import (check_batch_invariance, check_routing_errors, poison_moe_scratch,
                           require_kernel, same_bits)

from specmoe.kernels import elementwise, gemv, moe
from specmoe.kernels.gemv import PackedWeight
from specmoe.layers.linear import prepack_weights
from specmoe.layers.moe.experts import RoutedExperts
from specmoe.loader.weights import load_weights
from specmoe.models.weight_rules import rule
from tiny_models import random_bf16_experts, random_routing

KERNEL_UNAVAILABLE_REASON = moe.kernel_unavailable_reason  # for the `enabled` fixture
U = 2.0 ** -8  # bf16 unit roundoff (8 significant bits, round to nearest)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


_experts = random_bf16_experts


def _packed(experts: RoutedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    return experts.w13_panels.get(experts.w13), experts.w2_panels.get(experts.w2)


def _composition(x, ids, weights, w13p, w2p, intermediate, linear_kernel=None):
    """The same native kernels one call each: per active expert the bf16 linear kernel on
    its rows, the native SiLU-and-mul, the linear kernel again; then per token
    acc = 0, acc = acc + w[s] * y[s] for s = 0 .. k-1 in fp32, rounded once."""
    linear_kernel = linear_kernel or gemv._lazy.get()
    (t, h), k = x.shape, ids.shape[1]
    y = torch.empty(t, k, h, dtype=torch.bfloat16)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        gate_up = gemv.run_kernel(linear_kernel, x[rows].contiguous(), w13p[e],
                                  2 * intermediate, None)
        act = elementwise.try_silu_and_mul_bf16(gate_up)
        assert act is not None
        y[rows, slots] = gemv.run_kernel(linear_kernel, act, w2p[e], h, None)
    acc = torch.zeros(t, h)
    for s in range(k):
        acc = acc + weights[:, s:s + 1].float() * y[:, s].float()
    return acc.bfloat16()


@pytest.fixture
def natives(enabled):
    """The fused kernel, and the linear and elementwise kernels of the composition."""
    require_kernel("bf16 linear kernel", gemv.kernel_unavailable_reason())
    require_kernel("elementwise kernels", elementwise._lazy.unavailable_reason())


def _fused(experts: RoutedExperts, x, ids, weights, num_threads=None) -> torch.Tensor:
    out = moe.try_moe_bf16(x, ids, weights, experts.w13, experts.w2, experts.w13_panels,
                           experts.w2_panels, num_threads)
    assert out is not None, "the fused kernel did not apply"
    return out


# (N, H, I, k): N up to 256, k up to 8; H and 2I with partial panels, odd H, H not a
# multiple of 16 (masked tails of the final sum)
SHAPES = [(8, 64, 32, 2), (64, 48, 16, 8), (256, 32, 16, 8), (8, 100, 48, 3), (16, 33, 32, 4)]


@pytest.mark.parametrize("n,h,i,k", SHAPES)
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
def test_bit_exact_with_the_composition_of_native_kernels(natives, n, h, i, k, skewed):
    experts = _experts(n, h, i, seed=n + h)
    w13p, w2p = _packed(experts)
    gen = torch.Generator().manual_seed(n * k + skewed)
    for t in (1, 2, 5, 9, 17, 80, 320):
        x = torch.randn(t, h, generator=gen).bfloat16()
        dtype = torch.bfloat16 if t % 2 else torch.float32  # the router's bf16, or fp32
        ids, weights = random_routing(t, n, k, gen, skewed, dtype)
        out = _fused(experts, x, ids, weights)
        assert out.shape == (t, h) and out.dtype == torch.bfloat16
        assert same_bits(out, _composition(x, ids, weights, w13p, w2p, i)), f"T={t}"


def test_one_expert_with_more_rows_than_a_row_block(natives):
    """320 tokens on one expert (> 96 rows: several row blocks through its panels), and
    repeated ids within a token (each slot counted)."""
    experts = _experts(4, 64, 32)
    w13p, w2p = _packed(experts)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(320, 64, generator=gen).bfloat16()
    for ids in (torch.full((320, 1), 3), torch.tensor([[2, 2, 0]] * 320)):
        weights = torch.rand(*ids.shape, generator=gen)
        out = _fused(experts, x, ids, weights)
        assert same_bits(out, _composition(x, ids, weights, w13p, w2p, 32))


def _error_bound(experts_f32: RoutedExperts, x, ids, weights) -> torch.Tensor:
    """A first-order bound on |bf16 kernel - fp32 reference| per output, from the roundings
    (each at most U relative): gate/up rounded (the SiLU's slope stays below 1.1, so
    silu(g) * up moves by < 1.1 U |g| |up|), silu(g), up and their product rounded; the
    down output rounded; the final sum rounded."""
    t, k = ids.shape
    bound = torch.zeros(t, x.shape[1])
    inter = experts_f32.intermediate_size
    for s in range(k):
        for e in ids[:, s].unique().tolist():
            rows = (ids[:, s] == e).nonzero().flatten()
            gu = F.linear(x[rows].float(), experts_f32.w13[e])
            g, up = gu[:, :inter], gu[:, inter:]
            act = F.silu(g) * up
            e_act = U * (1.1 * g.abs() * up.abs() + 3 * act.abs())
            w2 = experts_f32.w2[e].abs()
            e_y = F.linear(e_act, w2) + U * F.linear(act.abs(), w2)
            bound[rows] += weights[rows, s:s + 1].float().abs() * e_y
    return bound


@pytest.mark.parametrize("n,h,i,k", [(8, 64, 32, 2), (64, 128, 48, 8), (256, 32, 16, 4)])
def test_within_bf16_rounding_of_the_fp32_reference(natives, n, h, i, k):
    experts = _experts(n, h, i, seed=3)
    experts_f32 = copy.deepcopy(experts).float()  # the same (bf16) values in fp32
    gen = torch.Generator().manual_seed(4)
    for t, skewed in [(1, False), (9, True), (80, False), (320, True)]:
        x = torch.randn(t, h, generator=gen).bfloat16()
        ids, weights = random_routing(t, n, k, gen, skewed)
        out = _fused(experts, x, ids, weights)
        with torch.no_grad():
            ref = experts_f32.forward_reference(x.float(), ids, weights)
        bound = _error_bound(experts_f32, x, ids, weights) + U * ref.abs() + 1e-6
        err = (out.float() - ref).abs()
        assert (err <= 1.25 * bound).all(), f"T={t}: worst {(err / bound).max():.2f} of bound"


def test_batch_invariance(natives):
    """Each token's output bits are the same alone (T = 1) as among 1..80 tokens, at any
    position, among any neighbours."""
    n, h, i, k = 64, 96, 32, 8
    experts = _experts(n, h, i, seed=5)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(80, h, generator=gen).bfloat16()
    ids, weights = random_routing(80, n, k, gen, skewed=True, dtype=torch.bfloat16)
    check_batch_invariance(lambda *args: _fused(experts, *args), x, ids, weights,
                           (2, 3, 9, 16, 17, 40, 79, 80), gen)


def test_thread_count_invariance(natives):
    """1 and 2 threads give the same bits, on a layer big enough that 2 threads do run
    (both routings: a skewed one splits an expert's panels between the threads)."""
    n, h, i, k = 64, 256, 128, 8
    experts = _experts(n, h, i, seed=6)
    w13p, w2p = _packed(experts)
    kernel = moe._lazy.get()
    gen = torch.Generator().manual_seed(6)
    for t, skewed in [(1, False), (9, True), (40, False), (100, True)]:
        x = torch.randn(t, h, generator=gen).bfloat16()
        ids, weights = random_routing(t, n, k, gen, skewed)
        poison_moe_scratch()
        one, used_one = moe.run_kernel(kernel, x, ids, weights, w13p, w2p, i, num_threads=1)
        poison_moe_scratch()
        two, used_two = moe.run_kernel(kernel, x, ids, weights, w13p, w2p, i, num_threads=2)
        assert used_one == 1 and used_two == 2, (t, used_two)
        assert same_bits(one, two), f"T={t}"
        assert same_bits(one, _composition(x, ids, weights, w13p, w2p, i))


def test_fma_variant_bit_exact_with_its_composition(natives, fma_variant):
    """The build without AVX512-BF16 (shift + FMA) matches the linear kernel's FMA build."""
    kernel, linear_kernel = fma_variant(moe.load_kernel), fma_variant(gemv.load_kernel)
    assert kernel.library.specmoe_moe_isa() == 1 == linear_kernel.library.specmoe_gemv_isa()
    experts = _experts(16, 64, 32, seed=7)
    w13p, w2p = _packed(experts)
    gen = torch.Generator().manual_seed(7)
    for t in (1, 9, 40):
        x = torch.randn(t, 64, generator=gen).bfloat16()
        ids, weights = random_routing(t, 16, 4, gen)
        out, _ = moe.run_kernel(kernel, x, ids, weights, w13p, w2p, 32)
        assert same_bits(out, _composition(x, ids, weights, w13p, w2p, 32, linear_kernel))


def test_no_tokens(natives):
    experts = _experts(8, 64, 32)
    out = _fused(experts, torch.zeros(0, 64, dtype=torch.bfloat16),
                 torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


def test_bad_inputs_raise_value_error(natives):
    n, h, i = 8, 64, 32
    experts = _experts(n, h, i)
    x = torch.randn(3, h).bfloat16()
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    w = torch.rand(3, 2)
    check_routing_errors(lambda *args: _fused(experts, *args), x, ids, w, n,
                         torch.randn(3, h + 1).bfloat16())
    with pytest.raises(ValueError, match="does not fit"):
        moe.try_moe_bf16(x, ids, w, experts.w13, experts.w2[:, :, :16], experts.w13_panels,
                         experts.w2_panels)
    with pytest.raises(ValueError, match="packed w2 must be"):
        moe.try_moe_bf16(x, ids, w, experts.w13, experts.w2, experts.w13_panels,
                         experts.w2_panels.get(experts.w2)[:4])


# ---- the "fused" backend ----------------------------------------------------------------


def test_forward_fused_is_the_kernel_and_survives_released_weights(natives):
    experts = _experts(16, 64, 32, seed=8)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(12, 64, generator=gen).bfloat16()
    ids, weights = random_routing(12, 16, 4, gen, dtype=torch.bfloat16)
    out = experts.forward_fused(x, ids, weights)
    assert same_bits(out, _fused(experts, x, ids, weights))
    prepack_weights(experts, release_dense=True)
    assert experts.w13.is_meta and experts.w2.is_meta
    assert same_bits(experts.forward_fused(x, ids, weights), out)


def test_forward_fused_falls_back_to_the_loop(natives, kernels_off):
    """Where the kernel does not apply (float32, an intermediate size the SiLU kernel does
    not take, kernels off) `forward_fused` is `forward`."""
    gen = torch.Generator().manual_seed(9)
    ids, weights = random_routing(5, 8, 2, gen)
    x = torch.randn(5, 64, generator=gen)

    def check(experts: RoutedExperts, x: torch.Tensor, weights: torch.Tensor) -> None:
        assert moe.try_moe_bf16(x, ids, weights, experts.w13, experts.w2,
                                experts.w13_panels, experts.w2_panels) is None
        torch.testing.assert_close(experts.forward_fused(x, ids, weights),
                                   experts.forward(x, ids, weights), atol=0, rtol=0)

    check(_experts(8, 64, 32).float(), x, weights)
    # RoutedExperts pads its width to a multiple of 16; the kernel itself declines others
    w13, w2 = torch.zeros(8, 48, 64).bfloat16(), torch.zeros(8, 64, 24).bfloat16()
    assert moe.try_moe_bf16(x.bfloat16(), ids, weights.bfloat16(), w13, w2, PackedWeight(),
                            PackedWeight()) is None
    with kernels_off():
        check(_experts(8, 64, 32), x.bfloat16(), weights.bfloat16())


def test_backend_registered_and_auto_picks_it():
    from specmoe.config import MOE_BACKEND_CHOICES
    from specmoe.layers.moe.backends import MOE_BACKENDS, PACKED_BACKENDS, resolve_moe_backend
    assert MOE_BACKENDS["fused"] is RoutedExperts.forward_fused
    assert "fused" in MOE_BACKEND_CHOICES and "fused" in PACKED_BACKENDS
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_moe_backend("auto", cpu, native_kernels=True) == "fused"
    assert resolve_moe_backend("auto", cpu, native_kernels=False) == "grouped_mm"
    assert resolve_moe_backend("auto", cuda, native_kernels=False) == "grouped_mm"
    assert resolve_moe_backend("fused", cpu, native_kernels=True) == "fused"


def test_set_moe_backend_fused_reads_the_packed_copies(natives):
    """A bf16 MoE block (with a gated shared expert) on "fused": its experts keep packed
    copies, the backend runs after the dense weights were released (the dense-weight
    backends then refuse), and the block's output bits stay the same."""
    from specmoe.config import MoEConfig
    from specmoe.layers.moe.backends import set_moe_backend
    from specmoe.layers.moe.block import SparseMoEBlock
    torch.manual_seed(10)
    moe_cfg = MoEConfig(num_experts=16, top_k=4, moe_intermediate_size=32,
                        norm_topk_prob=True, shared_expert_intermediate_size=48,
                        has_shared_expert_gate=True)
    block = SparseMoEBlock(64, moe_cfg, layer_idx=0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    block = block.to(torch.bfloat16).requires_grad_(False)
    model = torch.nn.Sequential(block)
    set_moe_backend(model, "fused")
    assert block.run_experts.__func__ is RoutedExperts.forward_fused
    assert block.experts.reads_packed
    x = torch.randn(7, 64).bfloat16()
    before = block(x)
    prepack_weights(model, release_dense=True)
    assert block.experts.w13.is_meta
    set_moe_backend(model, "fused")
    assert same_bits(block(x), before)
    with pytest.raises(ValueError, match="dense weights"):
        set_moe_backend(model, "grouped_mm")


def test_padded_expert_width_runs_fused_with_the_unpadded_results(natives):
    """Experts of width 28 (a carved checkpoint's kind of width) are stored padded to 32 with
    zero rows and columns by the weight loader: the fused kernel takes them, and its output
    is within bf16 rounding of the fp32 reference on the unpadded 28-wide weights."""
    n, h, i, k = 8, 64, 28, 2
    narrow = _experts(n, h, i, seed=6)
    gate, up = narrow.w13[:, :i], narrow.w13[:, 32:32 + i]  # the checkpoint's 28 rows
    down = narrow.w2[..., :i]
    rules = [rule(r"(?P<e>\d+)\.gate", "w13", 0), rule(r"(?P<e>\d+)\.up", "w13", 1),
             rule(r"(?P<e>\d+)\.down", "w2")]
    tensors = [(f"{e}.{name}", t[e]) for e in range(n)
               for name, t in (("gate", gate), ("up", up), ("down", down))]
    experts = RoutedExperts(n, h, i).bfloat16().requires_grad_(False)
    experts.w13.data.fill_(7.0)  # the loader must zero the padding
    experts.w2.data.fill_(7.0)
    load_weights(experts, tensors, rules, tied_embeddings=False)
    assert experts.intermediate_size == 32 and experts.w2.shape == (n, h, 32)
    assert not experts.w13[:, i:32].any() and not experts.w13[:, 32 + i:].any()
    assert not experts.w2[..., i:].any()
    dense = torch.cat([gate, up], dim=1).float()  # [N, 2 * 28, H], unpadded
    gen = torch.Generator().manual_seed(7)
    for t in (1, 9, 80):
        x = torch.randn(t, h, generator=gen).bfloat16()
        ids, weights = random_routing(t, n, k, gen)
        out = _fused(experts, x, ids, weights)
        ref = torch.zeros(t, h)
        for tok in range(t):
            for s in range(k):
                e = ids[tok, s]
                g, u = F.linear(x[tok].float(), dense[e]).split(i)
                ref[tok] += weights[tok, s] * F.linear(F.silu(g) * u, down[e].float())
        torch.testing.assert_close(out.float(), ref, rtol=0.03, atol=0.03)
