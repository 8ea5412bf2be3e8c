"""Server metrics in process: per-layer expert load of a MoE target (a tiny random Mixtral
saved with transformers), counters from engine snapshots, and per-app registries."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

from specmoe import LLM, SamplingParams
from specmoe.engine.async_engine import EngineSnapshot, FinishedRecord
from specmoe.entrypoints.openai.metrics import ServerMetrics
from specmoe.outputs import SpecDecodeStats

NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 4, 2


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> LLM:
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_mixtral")
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return LLM(str(path), dtype="float32")


def _samples(metrics: ServerMetrics, name: str) -> list:
    return [s for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples if s.name == name]


def _snapshot(spec: SpecDecodeStats, used: int = 0) -> EngineSnapshot:
    return EngineSnapshot(num_running=1, num_waiting=2, num_kv_blocks_used=used,
                          num_kv_blocks_total=10, num_prefix_queries=32, num_prefix_hits=16,
                          num_preemptions=0, spec=spec, num_step_failures=0)


def test_expert_load_counts_every_routed_token(tiny_moe):
    metrics = ServerMetrics("tiny")
    assert metrics.attach_expert_load(tiny_moe.target.model, every=1)
    prompt, max_tokens = [5, 6, 7, 8], 6
    tiny_moe.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                             ignore_eos=True))
    metrics.on_step(_snapshot(SpecDecodeStats()))
    samples = _samples(metrics, "specmoe:moe_expert_load_total")
    num_forwarded = len(prompt) + max_tokens - 1  # the last token is never fed back
    for layer in range(NUM_LAYERS):
        counts = [s.value for s in samples if s.labels["layer"] == str(layer)]
        assert sum(counts) == TOP_K * num_forwarded
        assert all(int(s.labels["expert"]) < NUM_EXPERTS for s in samples)


def test_expert_load_is_recorded_in_one_step_of_every_few(tiny_moe):
    from specmoe.layers.moe.backends import expert_stats, moe_blocks
    from specmoe.layers.moe.stats import NullExpertStats
    blocks, hub = moe_blocks(tiny_moe.target.model), expert_stats(tiny_moe.target.model)
    for recorder in hub.subscribers:  # as loaded (an earlier test subscribed its recorder)
        hub.unsubscribe(recorder)
    metrics = ServerMetrics("tiny")
    assert metrics.attach_expert_load(tiny_moe.target.model, every=3)
    recording = []
    for steps in range(1, 8):
        recording.append(hub.subscribers == (metrics.expert_load,)
                         and all(b.stats is hub for b in blocks))
        metrics.on_step(replace(_snapshot(SpecDecodeStats()), num_steps=steps))
    # sampled steps 3 and 6 record; the others keep the blocks' own no-op recorder, which the
    # fused decoder driver requires
    assert recording == [False, False, True, False, False, True, False]
    metrics.on_step(replace(_snapshot(SpecDecodeStats()), num_steps=9))
    assert all(type(b.stats) is NullExpertStats for b in blocks)
    with pytest.raises(ValueError, match="every=0"):
        ServerMetrics("x").attach_expert_load(tiny_moe.target.model, every=0)


def test_policy_metrics_follow_snapshots():
    m = ServerMetrics("m")
    snap = _snapshot(SpecDecodeStats())
    m.on_step(replace(snap, num_steps=2, draft_k_histogram={4: 2},
                      num_step_time_predictions=1, recent_step_time_errors=(0.5,),
                      num_trimmed_draft_tokens=3, num_shadow_draft_tokens=8,
                      num_shadow_accepted_tokens=2))
    m.on_step(replace(snap, num_steps=5, draft_k_histogram={0: 1, 4: 3},
                      num_trimmed_draft_tokens=7, num_shadow_draft_tokens=20,
                      num_shadow_accepted_tokens=5,
                      num_step_time_predictions=3,
                      recent_step_time_errors=(0.5, 0.02, 0.04),
                      realized_gain_factors={1: 0.75, 4: 1.0}))
    m.on_finished(FinishedRecord(10, 5, "length", 0.5, 1.3, acceptance_rate=0.75))
    m.on_finished(FinishedRecord(10, 5, "length", 0.5, 1.3))  # drafted nothing

    def one(name, **labels):
        return sum(s.value for s in _samples(m, name)
                   if all(s.labels.get(k) == v for k, v in labels.items()))
    assert one("specmoe:engine_steps_total") == 5
    assert one("specmoe:spec_decode_draft_k_count") == 4
    assert one("specmoe:spec_decode_draft_k_bucket", le="0.0") == 1
    assert one("specmoe:spec_decode_draft_k_sum") == 12
    assert one("specmoe:spec_decode_step_time_prediction_error_count") == 3
    assert one("specmoe:spec_decode_step_time_prediction_error_sum") == pytest.approx(0.56)
    assert one("specmoe:spec_decode_request_acceptance_rate_count") == 1
    assert one("specmoe:spec_decode_request_acceptance_rate_sum") == 0.75
    assert one("specmoe:spec_decode_realized_gain_factor", batch_size="1") == 0.75
    assert one("specmoe:spec_decode_realized_gain_factor", batch_size="4") == 1.0
    assert one("specmoe:spec_decode_num_trimmed_draft_tokens_total") == 7
    assert one("specmoe:spec_decode_num_shadow_draft_tokens_total") == 20
    assert one("specmoe:spec_decode_num_shadow_accepted_tokens_total") == 5


def test_dense_model_has_no_expert_load():
    metrics = ServerMetrics("dense")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not metrics.attach_expert_load(model)
    assert _samples(metrics, "specmoe:moe_expert_load_total") == []


def test_counters_follow_snapshots_and_registries_are_per_app():
    a, b = ServerMetrics("m"), ServerMetrics("m")  # two apps in one process do not clash
    spec = SpecDecodeStats()
    spec.record(4, 2)
    a.on_step(_snapshot(spec, used=3))
    spec.record(4, 4)
    a.on_step(_snapshot(spec, used=5))
    a.on_finished(FinishedRecord(10, 5, "length", ttft_s=0.5, e2e_s=1.3))

    def value(m, name, **labels):
        return sum(s.value for s in _samples(m, name)
                   if all(s.labels.get(k) == v for k, v in labels.items()))
    assert value(a, "specmoe:spec_decode_num_draft_tokens_total") == 8
    assert value(a, "specmoe:spec_decode_num_accepted_tokens_total") == 6
    assert value(a, "specmoe:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 2
    assert value(a, "specmoe:spec_decode_num_accepted_tokens_per_pos_total", position="3") == 1
    assert value(a, "specmoe:kv_cache_blocks_used") == 5
    assert value(a, "specmoe:prefix_cache_hits_total") == 16
    assert value(a, "specmoe:time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert value(a, "specmoe:request_success_total", finished_reason="length") == 1
    assert value(b, "specmoe:spec_decode_num_draft_tokens_total") == 0


def test_generation_tokens_count_as_steps_emit_them(tiny_moe):
    """Tokens of a request still running are counted: a snapshot after each step of a real
    engine moves the counter, before anything finished."""
    metrics = ServerMetrics("m")
    engine = tiny_moe.engine
    tiny_moe.add_request(tiny_moe.make_request(
        [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    start = engine.stats.num_generation_tokens
    seen = []
    while engine.has_unfinished_requests:
        finished = tiny_moe.step()
        emitted = engine.stats.num_generation_tokens - start
        metrics.on_step(replace(_snapshot(SpecDecodeStats()), num_generation_tokens=emitted))
        seen.append((bool(finished), _samples(metrics, "specmoe:generation_tokens_total")[0].value))
    assert seen[0] == (False, 1.0)  # the prefill's token, counted while the request runs
    assert seen[-1] == (True, 5.0)
    metrics.on_finished(FinishedRecord(3, 5, "length", ttft_s=0.1, e2e_s=0.2))
    assert _samples(metrics, "specmoe:generation_tokens_total")[0].value == 5.0
