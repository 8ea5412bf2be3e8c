"""int4 MoE layers in the fused decoder driver (`specmoe.models.fused_moe` with
`QuantizedRoutedExperts` and the fused int4 MoE kernel): after `--quantization int4` a MoE
model's forward of up to 16 rows is one native call with the modules' bits (hidden states,
logits and KV caches over prefills, decodes and multi-token verifications of several
sequences), on the bundled OLMoE `tiny-moe` and on a random Qwen2-MoE-style model (int4
shared expert with its bf16 sigmoid gate, dense and MoE layers mixed); more rows, or the
"reference" expert backend, send the forward to the modules; `LLM(..., quantization="int4")`
generates the same tokens with and without the driver."""

from __future__ import annotations

import contextlib

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.config import ArchConfig, ModelConfig, MoEConfig
from specmoe.kernels import decoder, moe_int4
from specmoe.layers.linear import prepack_weights
from specmoe.layers.moe.backends import moe_blocks, set_moe_backend
from specmoe.layers.paged_attention import AttentionMetadata, SequenceSlice
from specmoe.layers.quantization import Int4Linear, QuantizedRoutedExperts, quantize_model
from specmoe.loader.model_loader import default_dtype, load_model
from specmoe.models import fused_layers
from specmoe.models.decoder import DecoderModel
from specmoe.worker.kv_cache import PagedKVCache

KERNEL_UNAVAILABLE_REASON = decoder._lazy.unavailable_reason  # for `enabled`
BLOCK = 16
BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (start_pos, new tokens) per sequence per forward: at most 16 rows (the dense int4
# projections' limit in the driver) but for the last forward (18 rows: the modules run)
SCHEDULE = [[(0, 10), (0, 5)], [(10, 1), (5, 4)], [(11, 3), (9, 1), (0, 12)],
            [(14, 1), (10, 1), (12, 1)], [(15, 6), (11, 3), (13, 7)], [(21, 9), (14, 9)]]
DRIVER_STEPS = 5
TABLES = [[0, 1, 2, 3], [5, 4], [9, 7, 8, 10, 11]]


def _check_int4(model) -> None:
    blocks = moe_blocks(model)
    assert blocks and all(type(b.experts) is QuantizedRoutedExperts
                          and b.experts.method == "int4"
                          and b.run_experts.__func__ is QuantizedRoutedExperts.forward
                          for b in blocks)


@pytest.fixture(scope="module")
def tiny_moe_int4():
    loaded = load_model(ModelConfig("tiny-moe", dtype="bfloat16", device="cpu",
                                    quantization="int4"))
    _check_int4(loaded.model)
    return loaded.model, loaded.arch


def _qwen2_moe_int4(shared_gate: bool = True, seed: int = 0) -> tuple[DecoderModel, ArchConfig]:
    """A random Qwen2-MoE-style model whose projections and experts int4 can group (the LM
    head, 300 rows, falls back to int8; routers and the shared gate stay bf16)."""
    moe = MoEConfig(num_experts=16, top_k=4, moe_intermediate_size=64, norm_topk_prob=True,
                    shared_expert_intermediate_size=96, has_shared_expert_gate=shared_gate,
                    moe_layers=[0, 2])
    arch = ArchConfig(architecture="Qwen2MoeForCausalLM", vocab_size=300, hidden_size=128,
                      intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=512, attention_bias=True,
                      moe=moe)
    g = torch.Generator().manual_seed(seed)
    with default_dtype(BF16):
        model = DecoderModel(arch, 256)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1 + noise if name.endswith("norm.weight") else noise)
    model.eval().requires_grad_(False)
    set_moe_backend(model, "fused")
    quantize_model(model, "int4")
    prepack_weights(model, release_dense=True)
    _check_int4(model)
    return model, arch


def _run(model, arch, fused: bool, schedule=SCHEDULE):
    """Hidden states and logits of every forward of `schedule`, and the caches."""
    cache = PagedKVCache(arch, 12, BLOCK, BF16, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    outs = []
    was = fused_layers._enabled
    fused_layers.set_enabled(fused)
    try:
        with torch.inference_mode():
            for step in schedule:
                seqs = [SequenceSlice(s, n, TABLES[i]) for i, (s, n) in enumerate(step)]
                meta = AttentionMetadata.build(seqs, BLOCK, "cpu", arch.sliding_window)
                ids = torch.randint(0, arch.vocab_size, (meta.num_tokens,), generator=g)
                pos = torch.cat([torch.arange(s, s + n) for s, n in step])
                hidden = model(ids, pos, cache.layers, meta)
                outs += [hidden, model.compute_logits(hidden)]
    finally:
        fused_layers.set_enabled(was)
    return outs, cache


@contextlib.contextmanager
def _counting(monkeypatch):
    """Each call of the driver, as whether its table had int4 MoE layers; and each call of
    the fused int4 MoE kernel from Python (the modules')."""
    calls, kernel_calls = [], []
    real, real_kernel = decoder.run_layers, moe_int4.run_kernel

    def run(*a, **k):
        calls.append(decoder.MoeSizes(a[1]).int4)
        return real(*a, **k)

    monkeypatch.setattr(decoder, "run_layers", run)
    monkeypatch.setattr(moe_int4, "run_kernel",
                        lambda *a, **k: kernel_calls.append(1) or real_kernel(*a, **k))
    yield calls, kernel_calls


def _assert_same(a, b) -> None:
    (outs_a, cache_a), (outs_b, cache_b) = a, b
    for x, y in zip(outs_a, outs_b, strict=True):
        assert x.dtype is y.dtype and torch.equal(x, y)
    for (ka, va), (kb, vb) in zip(cache_a.layers, cache_b.layers, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_tiny_moe_int4_fused_gives_the_module_bits(enabled, monkeypatch, tiny_moe_int4):
    model, arch = tiny_moe_int4
    with _counting(monkeypatch) as (calls, kernel_calls):
        fused = _run(model, arch, True)
    # every forward of up to 16 rows was one native call, with int4 MoE layers; the
    # 18-row one ran the modules (which call the fused int4 kernel from Python)
    assert calls == [True] * DRIVER_STEPS
    assert len(kernel_calls) == arch.num_hidden_layers
    _assert_same(fused, _run(model, arch, False))


@pytest.mark.parametrize("shared_gate", [True, False])
def test_int4_shared_expert_and_mixed_layers_give_the_module_bits(enabled, monkeypatch,
                                                                  shared_gate):
    model, arch = _qwen2_moe_int4(shared_gate)
    block = moe_blocks(model)[0]
    assert isinstance(block.shared_expert.gate_up_proj, Int4Linear)
    assert isinstance(block.shared_expert.down_proj, Int4Linear)
    with _counting(monkeypatch) as (calls, _):
        fused = _run(model, arch, True)
    assert calls == [True] * DRIVER_STEPS
    _assert_same(fused, _run(model, arch, False))


def test_the_reference_backend_sends_forwards_to_the_modules(enabled, monkeypatch):
    model, arch = _qwen2_moe_int4()
    _run(model, arch, True, schedule=SCHEDULE[:1])  # a table built first
    set_moe_backend(model, "reference")
    with _counting(monkeypatch) as (calls, _):
        after = _run(model, arch, True, schedule=SCHEDULE[:2])
    assert calls == []
    _assert_same(after, _run(model, arch, False, schedule=SCHEDULE[:2]))


def test_llm_int4_generates_the_same_tokens_with_the_driver(enabled, monkeypatch):
    prompts = ["The city council approved the new budget on Tuesday, and the mayor said",
               "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM("tiny-moe", dtype="bfloat16", device="cpu", quantization="int4")
    was = fused_layers._enabled
    try:
        fused_layers.set_enabled(False)
        ref = [o.token_ids for o in llm.generate(prompts, params)]
        fused_layers.set_enabled(True)
        llm.reset_prefix_cache()
        with _counting(monkeypatch) as (calls, _):
            outs = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        fused_layers.set_enabled(was)
    assert outs == ref
    assert calls.count(True) >= 15  # each decode step one native call
