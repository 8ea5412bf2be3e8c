"""MoE layers in the fused decoder driver (`specmoe.models.fused_layers` with
`specmoe.models.fused_moe`): a MoE model's forward is one native call that gives the
modules' bits (hidden states, logits and KV caches over prefills, decodes and multi-token
verifications of several sequences) on the bundled OLMoE `tiny-moe` in bf16 and on random
Qwen2-MoE-style models (shared expert with its sigmoid gate, dense and MoE layers mixed);
routing ties resolve to the lower expert id; greedy speculation with the driver equals
greedy without it; hooks, an expert-stats recorder or another expert backend send the
forward to the modules."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kernel_checks import assert_same_runs, fused_driver, run_schedule

from specmoe import LLM, SamplingParams
from specmoe.config import ArchConfig, ModelConfig
from specmoe.kernels import decoder
from specmoe.layers.linear import prepack_weights
from specmoe.layers.moe.backends import expert_stats, moe_blocks, set_moe_backend
from specmoe.layers.moe.stats import ExpertStatsRecorder
from specmoe.loader.model_loader import default_dtype, load_model
from specmoe.models.decoder import DecoderModel
from specmoe.worker.kv_cache import PagedKVCache
from tiny_models import qwen2_moe_arch, randomize_

KERNEL_UNAVAILABLE_REASON = decoder._lazy.unavailable_reason  # for `enabled`
BF16 = torch.bfloat16

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (start_pos, new tokens) per sequence per forward: prefills (one of 70 rows: the sigmoid's
# vector loop), then decodes and verifications of several rows side by side
SCHEDULE = [[(0, 40), (0, 7)], [(40, 1), (7, 5)], [(41, 4), (12, 1), (0, 70)],
            [(45, 1), (13, 1), (70, 1)], [(46, 5), (14, 3), (71, 2)]]
TABLES = [[0, 1, 2, 3], [5, 4], [9, 7, 8, 10, 11]]


@pytest.fixture(scope="module")
def tiny_moe():
    loaded = load_model(ModelConfig("tiny-moe", dtype="bfloat16", device="cpu",
                                    moe_backend="fused"))
    return loaded.model, loaded.arch


def _qwen2_moe(shared_gate: bool = True, seed: int = 0, zero_router: bool = False
               ) -> tuple[DecoderModel, ArchConfig]:
    arch = qwen2_moe_arch(48, shared_gate)
    with default_dtype(BF16):
        model = randomize_(DecoderModel(arch, 256), seed, zero_router)
    set_moe_backend(model, "fused")
    prepack_weights(model, release_dense=True)
    return model, arch


def _run(model, arch, fused: bool, schedule=SCHEDULE, cache: PagedKVCache | None = None):
    """Hidden states and logits of every forward of `schedule`, and the caches."""
    return run_schedule(model, arch, fused, schedule, TABLES, cache, logits=True)


@contextlib.contextmanager
def _counting(monkeypatch):
    """Each call of the driver, as whether its table had MoE layers."""
    calls = []
    real = decoder.run_layers

    def run(*a, **k):
        calls.append(decoder.MoeSizes(a[1]).any)
        return real(*a, **k)

    monkeypatch.setattr(decoder, "run_layers", run)
    yield calls


def test_tiny_moe_fused_gives_the_module_bits(enabled, monkeypatch, tiny_moe):
    model, arch = tiny_moe
    assert arch.moe is not None and all(
        b.run_experts.__name__ == "forward_fused" for b in moe_blocks(model))
    with _counting(monkeypatch) as calls:
        fused = _run(model, arch, True)
    assert calls == [True] * len(SCHEDULE)  # every forward was one native call
    assert_same_runs(fused, _run(model, arch, False))


@pytest.mark.parametrize("shared_gate", [True, False])
def test_shared_expert_and_mixed_layers_give_the_module_bits(enabled, monkeypatch,
                                                             shared_gate):
    model, arch = _qwen2_moe(shared_gate)
    with _counting(monkeypatch) as calls:
        fused = _run(model, arch, True)
    assert len(calls) == len(SCHEDULE)
    assert_same_runs(fused, _run(model, arch, False))


def test_routing_ties_go_to_the_lower_expert_id(enabled, monkeypatch):
    """A zero router gate ties every expert: each token takes experts 0 .. k-1, in the
    driver as in the modules."""
    model, arch = _qwen2_moe(zero_router=True)
    with _counting(monkeypatch) as calls:
        fused = _run(model, arch, True)
    assert len(calls) == len(SCHEDULE)
    assert_same_runs(fused, _run(model, arch, False))
    recorder = ExpertStatsRecorder()
    expert_stats(model).subscribe(recorder)
    _run(model, arch, True, schedule=SCHEDULE[:1])
    k = arch.moe.top_k
    for layer in arch.moe.moe_layers:
        assert torch.equal(recorder.routing[layer][0], torch.arange(k).expand(47, k))


def _recorder(model):
    expert_stats(model).subscribe(ExpertStatsRecorder())


def _hook(model):
    moe_blocks(model)[0].register_forward_hook(lambda mod, args, out: out * 0.5)


def _router_hook(model):
    moe_blocks(model)[-1].router.gate.register_forward_pre_hook(lambda mod, args: None)


def _grouped(model):
    set_moe_backend(model, "grouped")


@pytest.mark.parametrize("change", [_recorder, _hook, _router_hook, _grouped])
def test_hooks_recorders_and_other_backends_send_forwards_to_the_modules(enabled, monkeypatch,
                                                                         change):
    model, arch = _qwen2_moe()
    change(model)
    with _counting(monkeypatch) as calls:
        after = _run(model, arch, True)
    assert calls == []
    assert_same_runs(after, _run(model, arch, False))


def test_a_recorder_attached_after_the_table_was_built_is_served(enabled, monkeypatch):
    """A subscription puts the hub in the blocks' `stats` slot, a plain attribute: the cached
    table must notice it."""
    model, arch = _qwen2_moe()
    _, cache = _run(model, arch, True, schedule=SCHEDULE[:1])
    recorder = ExpertStatsRecorder()
    expert_stats(model).subscribe(recorder)
    with _counting(monkeypatch) as calls:  # the same caches: no rebuild forced
        _run(model, arch, True, schedule=SCHEDULE[1:3], cache=cache)
    assert calls == [] and len(recorder.routing[0]) == 2


def test_a_recorder_detached_lets_the_driver_run_again(enabled, monkeypatch):
    model, arch = _qwen2_moe()
    recorder = ExpertStatsRecorder()
    expert_stats(model).subscribe(recorder)
    expert_stats(model).unsubscribe(recorder)
    with _counting(monkeypatch) as calls:
        _run(model, arch, True, schedule=SCHEDULE[:2])
    assert len(calls) == 2


@pytest.mark.parametrize("speculative", [
    {"method": "draft", "draft_model": "tiny-moe-draft", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 3},
], ids=["draft_model", "ngram"])
def test_greedy_speculation_with_the_driver_equals_greedy_without(enabled, monkeypatch,
                                                                  speculative):
    prompts = ["The city council approved the new budget on Tuesday, and the mayor said",
               "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
               "Die Stadt liegt am Ufer des Flusses und hat etwa zwanzigtausend"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM("tiny-moe", dtype="bfloat16", device="cpu", moe_backend="fused")
    with fused_driver(False):
        ref = [o.token_ids for o in llm.generate(prompts, params)]
    with fused_driver(True), _counting(monkeypatch) as calls:
        outs = llm.with_speculative(speculative).generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert any(calls) and sum(o.spec_stats.num_drafts for o in outs) > 0
