"""Quantised routed experts (`specmoe.layers.quantization.QuantizedRoutedExperts`): the int4
layout is `gemv_int4.pack_int4`'s, the layer is within rounding of its plain-torch reference
on random and skewed routings, batch-invariant where the int4 kernel is, ~3.2x (int4) and
~2x (int8) fewer weight bytes with the bf16 weights freed; `quantize_model` quantises the
routed and shared experts of real MoE checkpoints, and on tiny-moe int4 generation runs, the
fused decoder driver runs its decode steps, and greedy speculation stays lossless."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
import transformers

from specmoe import LLM, SamplingParams
from specmoe.config import ModelConfig, MoEConfig
from specmoe.kernels import decoder, gemv_int4
from specmoe.layers.linear import prepack_weights
from specmoe.layers.moe.backends import moe_blocks, set_moe_backend
from specmoe.layers.moe.block import SparseMoEBlock
from specmoe.layers.moe.experts import RoutedExperts
from specmoe.layers.quantization import (Int4Linear, QuantizedRoutedExperts,
                                         int4_dequantize, int4_unpack_dequantize,
                                         pack_int4_groups, quantize_int4, quantize_model,
                                         speculation_caveat)
from specmoe.loader.model_loader import load_model
from kernel_checks import int4_batch_invariant
from tiny_models import random_bf16_experts

U = 2.0 ** -8  # bf16 unit roundoff
KERNEL_UNAVAILABLE_REASON = gemv_int4.kernel_unavailable_reason  # for the `enabled` fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


_experts = random_bf16_experts


def _routing(t: int, n: int, k: int, gen: torch.Generator, skewed: bool = False):
    """k distinct experts per token, positive weights; skewed: most tokens share experts
    0 and 1 (more than 32 rows for one expert from T = 36)."""
    scores = torch.rand(t, n, generator=gen)
    if skewed:
        scores[:, :2] += 10 * (torch.rand(t, 1, generator=gen) < 0.9)
    return scores.topk(k, dim=-1).indices, torch.rand(t, k, generator=gen) + 0.1


@pytest.fixture
def batch_invariant():
    """gemv_int4's batch-invariant mode on for one test."""
    with int4_batch_invariant():
        yield


def test_int4_layout_is_pack_int4s():
    w = torch.randn(128, 96) * 0.1 + 0.05
    packed, scales, zeros = pack_int4_groups(w)
    q, sz = quantize_int4(w)
    for a, b in zip((packed, scales, zeros), gemv_int4.pack_int4(q, sz), strict=True):
        assert a.dtype is b.dtype and torch.equal(a, b)
    assert torch.equal(int4_unpack_dequantize(packed, scales, zeros),
                       int4_dequantize(q, sz, 32, torch.float32))


def _dequantized_f32(qe: QuantizedRoutedExperts) -> RoutedExperts:
    """fp32 `RoutedExperts` holding exactly the quantised experts' values."""
    ref = RoutedExperts(qe.num_experts, qe.hidden_size, qe.intermediate_size).float()
    with torch.no_grad():
        for e in range(qe.num_experts):
            ref.w13[e] = qe.dequantized("w13", e)
            ref.w2[e] = qe.dequantized("w2", e)
    return ref.requires_grad_(False)


def _error_bound(ref: RoutedExperts, x, ids, weights) -> torch.Tensor:
    """First-order bound on |layer - fp32 math on the quantised values| per output, from
    the bf16 roundings (each at most U relative): gate/up outputs rounded, and each weight
    rounded to bf16 where more than 32 rows meet an expert (int4: bf16 slices) or by the
    int8 kernel; silu(g), the product, the down output (and its weights) rounded; then the
    final sum (added by the caller)."""
    t, k = ids.shape
    bound = torch.zeros(t, x.shape[1])
    inter = ref.intermediate_size
    xf = x.float()
    for s in range(k):
        for e in ids[:, s].unique().tolist():
            rows = (ids[:, s] == e).nonzero().flatten()
            gu = F.linear(xf[rows], ref.w13[e])
            e_gu = U * (gu.abs() + F.linear(xf[rows].abs(), ref.w13[e].abs()))
            g, up = gu[:, :inter], gu[:, inter:]
            act = F.silu(g) * up
            e_act = (1.1 * e_gu[:, :inter] * up.abs() + F.silu(g).abs() * e_gu[:, inter:]
                     + 2 * U * act.abs())
            w2 = ref.w2[e].abs()
            e_y = F.linear(e_act, w2) + 2 * U * F.linear(act.abs(), w2)
            bound[rows] += weights[rows, s:s + 1].float().abs() * e_y
    return bound


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("n,h,i,k", [(8, 64, 32, 1), (8, 96, 64, 3), (64, 128, 96, 8)])
def test_within_rounding_of_the_reference(method, n, h, i, k):
    qe = QuantizedRoutedExperts.from_experts(_experts(n, h, i, seed=n + k), method)
    assert qe.method == method
    ref = _dequantized_f32(qe)
    gen = torch.Generator().manual_seed(k)
    for t, skewed in [(1, False), (2, False), (5, True), (17, False), (40, True),
                      (80, False)]:
        x = torch.randn(t, h, generator=gen).bfloat16()
        ids, weights = _routing(t, n, k, gen, skewed)
        out = qe(x, ids, weights)
        assert out.dtype is torch.bfloat16 and out.shape == (t, h)
        exact = ref.forward_reference(x.float(), ids, weights)  # fp32, same weight values
        bound = _error_bound(ref, x, ids, weights) + U * exact.abs() + 1e-6
        err = (out.float() - exact).abs()
        assert (err <= 1.25 * bound).all(), f"T={t}: worst {(err / bound).max():.2f} of bound"
        # the module's own plain-torch reference, also within those roundings
        own = qe.forward_reference(x, ids, weights).float()
        assert ((own - exact).abs() <= 1.25 * bound).all()


def test_float32_activations_and_no_tokens():
    qe = QuantizedRoutedExperts.from_experts(_experts(8, 64, 32), "int4")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen)
    ids, weights = _routing(6, 8, 2, gen)
    out = qe(x, ids, weights)
    assert out.dtype is torch.float32
    torch.testing.assert_close(out, qe.forward_reference(x, ids, weights), atol=0.03, rtol=0.03)
    empty = qe(x[:0], ids[:0], weights[:0])
    assert empty.shape == (0, 64)


def test_kernels_off_runs_the_reference_math(kernels_off):
    qe = QuantizedRoutedExperts.from_experts(_experts(8, 64, 32, seed=2), "int4")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    ids, weights = _routing(9, 8, 2, gen)
    on = qe(x, ids, weights)
    with kernels_off():
        off = qe(x, ids, weights)
    torch.testing.assert_close(off.float(), on.float(), atol=0.02, rtol=0.02)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype is b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _invariance(qe, x, ids, weights, sizes, gen) -> None:
    alone = torch.cat([qe(x[j:j + 1], ids[j:j + 1], weights[j:j + 1])
                       for j in range(x.shape[0])])
    for size in sizes:
        pick = torch.randperm(x.shape[0], generator=gen)[:size]
        assert _bits(qe(x[pick], ids[pick], weights[pick]), alone[pick]), f"{size} tokens"


def test_batch_invariant_up_to_32_rows_per_expert(enabled):
    n, h, i, k = 64, 96, 64, 8
    qe = QuantizedRoutedExperts.from_experts(_experts(n, h, i, seed=5), "int4")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(32, h, generator=gen).bfloat16()
    ids, weights = _routing(32, n, k, gen, skewed=True)
    _invariance(qe, x, ids, weights, (2, 3, 9, 16, 17, 32), gen)  # <= 32 rows per expert


def test_batch_invariant_mode_any_number_of_rows(enabled, batch_invariant):
    n, h, i, k = 64, 96, 64, 8
    qe = QuantizedRoutedExperts.from_experts(_experts(n, h, i, seed=6), "int4")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(80, h, generator=gen).bfloat16()
    ids, weights = _routing(80, n, k, gen, skewed=True)  # experts 0, 1: ~72 rows each
    _invariance(qe, x, ids, weights, (40, 79, 80), gen)


def test_weight_bytes_shrink_and_the_bf16_weights_are_freed():
    n, h, i = 16, 256, 96
    dense_bytes = 3 * n * h * i * 2  # w13 and w2 in bf16
    for method, ratio in (("int4", 2 / 0.625), ("int8", 2.0)):
        experts = _experts(n, h, i)
        qe = QuantizedRoutedExperts.from_experts(experts, method)
        assert qe.weight_bytes() == pytest.approx(dense_bytes / ratio, rel=0.02)
        assert not list(qe.parameters())  # nothing bf16 left
    # in a model: the old experts (and their bf16 weights) are gone after quantize_model
    model = _moe_blocks(2)
    old = [weakref.ref(b.experts) for b in model]
    before = sum(b.experts.w13.nbytes + b.experts.w2.nbytes for b in model)
    assert quantize_model(model, "int4") == 2
    gc.collect()
    assert all(r() is None for r in old)
    after = sum(b.experts.weight_bytes() for b in model)
    assert before / after == pytest.approx(3.2)
    assert all(b.run_experts.__self__ is b.experts for b in model)


def _moe_blocks(num: int, h: int = 64, i: int = 32, n: int = 8) -> torch.nn.ModuleList:
    blocks = torch.nn.ModuleList(
        SparseMoEBlock(h, MoEConfig(num_experts=n, top_k=2, moe_intermediate_size=i,
                                    norm_topk_prob=True), j)
        for j in range(num))
    for b in blocks:
        b.experts = _experts(n, h, i, seed=b.layer_idx)
        b.run_experts = b.experts.forward
    return blocks.to(torch.bfloat16).requires_grad_(False)


def test_released_dense_weights_quantise_from_their_packed_copies(enabled):
    """Packed copies replace the dense weights only where the native kernels run."""
    experts = _experts(8, 64, 32, seed=4)
    want = QuantizedRoutedExperts.from_experts(experts, "int4")
    prepack_weights(experts, release_dense=True)
    assert experts.w13.is_meta
    got = QuantizedRoutedExperts.from_experts(experts, "int4")
    for a, b in zip(want.buffers(), got.buffers(), strict=True):
        assert torch.equal(a, b)


def _qwen2_moe_model(seed: int):
    cfg = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      moe_intermediate_size=64,
                                      shared_expert_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=8,
                                      num_experts_per_tok=2)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2moe")
    _qwen2_moe_model(seed=0).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantize_model_quantises_routed_and_shared_experts(qwen2_moe_dir, method):
    from specmoe.worker.model_runner import ModelRunner
    full = ModelRunner(load_model(ModelConfig(qwen2_moe_dir, dtype="bfloat16")))
    quant = ModelRunner(load_model(ModelConfig(qwen2_moe_dir, dtype="bfloat16",
                                               quantization=method)))
    for block in moe_blocks(quant.model):
        assert isinstance(block.experts, QuantizedRoutedExperts)
        assert block.experts.method == method
        assert block.run_experts.__self__ is block.experts
        kind = "Int4Linear" if method == "int4" else "Int8Linear"
        assert type(block.shared_expert.gate_up_proj).__name__ == kind
        assert type(block.shared_expert.down_proj).__name__ == kind
        assert type(block.shared_expert_gate).__name__ == "Linear"  # kept
        assert type(block.router.gate).__name__ == "Linear"
    ids = list(range(3, 30))
    ref = full.forward(full.new_cache(64), ids).float()
    out = quant.forward(quant.new_cache(64), ids).float()
    assert torch.isfinite(out).all()
    limit = 0.25 if method == "int4" else 0.05  # of the largest logit: int4 errs ~8%
    assert 0 < (out - ref).abs().max() < limit * ref.abs().max()


def test_every_backend_runs_quantised_experts(qwen2_moe_dir):
    model = load_model(ModelConfig(qwen2_moe_dir, dtype="bfloat16", quantization="int4")).model
    block = moe_blocks(model)[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    ids, weights = _routing(5, 8, 2, gen)
    want = block.experts(x, ids, weights)
    for name in ("fused", "grouped", "grouped_mm", "reference"):
        set_moe_backend(model, name)
        got = block.run_experts(x, ids, weights)
        if name == "reference":
            torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=0.02)
        else:
            assert _bits(got, want)


@pytest.fixture(scope="module")
def tiny_moe_int4():
    return LLM("tiny-moe", dtype="bfloat16", device="cpu", quantization="int4")


PROMPTS = ["The city council approved the new budget on Tuesday, and the mayor said",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]


def test_tiny_moe_int4_quantises_the_experts_and_generates(enabled, tiny_moe_int4, monkeypatch):
    """On the native kernels (the fused decoder driver runs only there)."""
    model = tiny_moe_int4.target.model
    blocks = moe_blocks(model)
    assert blocks and all(isinstance(b.experts, QuantizedRoutedExperts)
                          and b.experts.method == "int4" for b in blocks)
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    bf16_bytes = sum(3 * b.experts.num_experts * b.experts.hidden_size
                     * b.experts.intermediate_size * 2 for b in blocks)
    assert bf16_bytes / sum(b.experts.weight_bytes() for b in blocks) == pytest.approx(3.2)
    calls = []
    real = decoder.run_layers
    monkeypatch.setattr(decoder, "run_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = tiny_moe_int4.generate(PROMPTS, params)
    assert calls  # decode steps (<= 16 rows) ran in the fused decoder driver
    for o in outs:
        assert len(o.token_ids) == 16 and all(0 <= t < 4096 for t in o.token_ids)
    ids = tiny_moe_int4.tokenizer.encode(PROMPTS[0])
    runner = tiny_moe_int4.target
    logits = runner.forward(runner.new_cache(64), ids)
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("invariant_mode", [True, False])
def test_tiny_moe_int4_greedy_speculation_is_lossless(enabled, tiny_moe_int4, invariant_mode):
    """Lossless in batch-invariant mode; by default too while no forward gives an expert or
    a dense layer more than 32 rows (these two short prompts: ~30 rows at most)."""
    was = gemv_int4.is_batch_invariant()
    gemv_int4.set_batch_invariant(invariant_mode)
    try:
        caveat = speculation_caveat(tiny_moe_int4.target.model)
        assert (caveat is None) == invariant_mode
        tiny_moe_int4.reset_prefix_cache()  # cached KV of the other mode would differ
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        ref = [o.token_ids for o in tiny_moe_int4.generate(PROMPTS, params)]
        spec = tiny_moe_int4.with_speculative({"method": "ngram",
                                               "num_speculative_tokens": 3})
        outs = spec.generate(PROMPTS, params)
    finally:
        gemv_int4.set_batch_invariant(was)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.spec_stats.num_drafts for o in outs) > 0


def test_speculation_caveat_names_quantised_experts(enabled, qwen2_moe_dir, monkeypatch):
    int8 = load_model(ModelConfig(qwen2_moe_dir, dtype="bfloat16", quantization="int8")).model
    assert "int8" in speculation_caveat(int8)
    experts = copy.deepcopy(moe_blocks(int8)[0].experts)
    assert "int8 experts" in speculation_caveat(torch.nn.ModuleList([experts]))
    int4 = QuantizedRoutedExperts.from_experts(_experts(8, 64, 32), "int4")
    monkeypatch.setattr(gemv_int4, "_batch_invariant", False)
    assert "per expert" in speculation_caveat(int4)
    monkeypatch.setattr(gemv_int4, "_batch_invariant", True)
    assert speculation_caveat(int4) is None
    monkeypatch.setattr(gemv_int4, "cpu_unsupported_reason", lambda: "no AVX-512")
    assert "cannot run" in speculation_caveat(int4)
