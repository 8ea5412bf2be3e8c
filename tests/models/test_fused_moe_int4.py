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
from kernel_checks import assert_same_runs, fused_driver, run_schedule

from specmoe import LLM, SamplingParams
from specmoe.config import ArchConfig, ModelConfig
from specmoe.kernels import decoder, moe_int4
from specmoe.layers.linear import prepack_weights
from specmoe.layers.moe.backends import moe_blocks, set_moe_backend
from specmoe.layers.quantization import Int4Linear, QuantizedRoutedExperts, quantize_model
from specmoe.loader.model_loader import default_dtype, load_model
from specmoe.models.decoder import DecoderModel
from tiny_models import qwen2_moe_arch, randomize_

KERNEL_UNAVAILABLE_REASON = decoder._lazy.unavailable_reason  # for `enabled`
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
    arch = qwen2_moe_arch(64, shared_gate)
    with default_dtype(BF16):
        model = randomize_(DecoderModel(arch, 256), seed)
    set_moe_backend(model, "fused")
    quantize_model(model, "int4")
    prepack_weights(model, release_dense=True)
    _check_int4(model)
    return model, arch


def _run(model, arch, fused: bool, schedule=SCHEDULE):
    """Hidden states and logits of every forward of `schedule`, and the caches."""
    return run_schedule(model, arch, fused, schedule, TABLES, logits=True)


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


def test_tiny_moe_int4_fused_gives_the_module_bits(enabled, monkeypatch, tiny_moe_int4):
    model, arch = tiny_moe_int4
    with _counting(monkeypatch) as (calls, kernel_calls):
        fused = _run(model, arch, True)
    # every forward of up to 16 rows was one native call, with int4 MoE layers; the
    # 18-row one ran the modules (which call the fused int4 kernel from Python)
    assert calls == [True] * DRIVER_STEPS
    assert len(kernel_calls) == arch.num_hidden_layers
    assert_same_runs(fused, _run(model, arch, False))


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
    assert_same_runs(fused, _run(model, arch, False))


def test_the_reference_backend_sends_forwards_to_the_modules(enabled, monkeypatch):
    model, arch = _qwen2_moe_int4()
    _run(model, arch, True, schedule=SCHEDULE[:1])  # a table built first
    set_moe_backend(model, "reference")
    with _counting(monkeypatch) as (calls, _):
        after = _run(model, arch, True, schedule=SCHEDULE[:2])
    assert calls == []
    assert_same_runs(after, _run(model, arch, False, schedule=SCHEDULE[:2]))


def test_llm_int4_generates_the_same_tokens_with_the_driver(enabled, monkeypatch):
    prompts = ["The city council approved the new budget on Tuesday, and the mayor said",
               "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM("tiny-moe", dtype="bfloat16", device="cpu", quantization="int4")
    with fused_driver(False):
        ref = [o.token_ids for o in llm.generate(prompts, params)]
    llm.reset_prefix_cache()
    with fused_driver(True), _counting(monkeypatch) as (calls, _):
        outs = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs == ref
    assert calls.count(True) >= 15  # each decode step one native call
