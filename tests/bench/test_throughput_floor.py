"""The throughput bench's floor: matmul counts from an architecture, each step's roofline,
the runs' floors and the bound they put on the scaling target, and the probes behind it."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

from specmoe.bench import roofline
from specmoe.bench.throughput import (ThroughputBenchConfig, add_floors, aggregate, ratios,
                                      slowest_steps, target_line)
from specmoe.bench.throughput_floor import (Machine, MatmulCounts, run_floor_seconds,
                                            step_floor_seconds)
from specmoe.bench.throughput_report import bound_sentence, markdown
from specmoe.config import ArchConfig, MoEConfig
from specmoe.kernels import peak


def _arch(**kw) -> ArchConfig:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=4,
                  intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=2, rms_norm_eps=1e-6, rope_theta=1e4,
                  max_position_embeddings=64)
    return ArchConfig(**(fields | kw))


def test_dense_counts_match_smollm2_135m():
    # SmolLM2-135M: 134,515,008 parameters = body + tied head + 61 RMSNorm weights of 576
    arch = _arch(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 head_dim=64)
    c = MatmulCounts.from_arch(arch, 2.0)
    assert c.head_params == 49152 * 576
    assert c.body_params + c.head_params + 61 * 576 == 134_515_008
    assert c.min_weight_bytes == 2 * (c.body_params + c.head_params)
    assert c.flops_per_token == 2 * (c.body_params + c.head_params)


def test_moe_counts_only_top_k_experts():
    moe = MoEConfig(num_experts=8, top_k=2, moe_intermediate_size=3, norm_topk_prob=True,
                    shared_expert_intermediate_size=5, has_shared_expert_gate=True,
                    moe_layers=[1])
    c = MatmulCounts.from_arch(_arch(moe=moe), 0.5)
    attn = 4 * (4 + 2 * 2) + 4 * 4
    dense_layer = attn + 3 * 4 * 8
    moe_layer = attn + 4 * 8 + (3 * 4 * 5 + 4) + 2 * 3 * 4 * 3  # router, shared + gate, 2 experts
    assert c.body_params == dense_layer + moe_layer
    assert c.min_weight_bytes == 0.5 * (c.body_params + 40)
    with pytest.raises(ValueError, match="bytes_per_weight=0"):
        MatmulCounts.from_arch(_arch(), 0)


def test_step_floor_is_the_slower_of_flops_and_uncached_bytes():
    c = MatmulCounts(body_params=100, head_params=10, min_weight_bytes=1000.0)
    m = Machine(peak_flops=1000.0, bandwidth=100.0)
    assert step_floor_seconds(c, m, 1, 1) == pytest.approx(10.0)  # bytes: 1000 / 100
    assert step_floor_seconds(c, m, 64, 64) == pytest.approx(2 * 110 * 64 / 1000)  # flops
    assert step_floor_seconds(c, m, 64, 0) == pytest.approx(2 * 100 * 64 / 1000)
    cached = Machine(peak_flops=1000.0, bandwidth=100.0, cache_bytes=600)
    assert step_floor_seconds(c, cached, 1, 1) == pytest.approx(4.0)
    assert step_floor_seconds(c, Machine(1000.0, 100.0, 5000), 1, 0) == pytest.approx(0.2)
    assert run_floor_seconds(c, m, [(1, 1), (64, 64)]) == pytest.approx(10.0 + 14.08)
    for bad in ({"peak_flops": 0.0, "bandwidth": 1.0}, {"peak_flops": 1.0, "bandwidth": 0.0},
                {"peak_flops": 1.0, "bandwidth": 1.0, "cache_bytes": -1}):
        with pytest.raises(ValueError, match="invalid machine"):
            Machine(**bad)


def _run(rep, c, tps, steps):
    n = 8 * c
    return {"mode": "plain", "rep": rep, "concurrency": c, "wall_seconds": n / tps,
            "num_output_tokens": n, "tokens_per_s": tps,
            "requests": [{"prompt_index": 0, "num_prompt_tokens": 10, "num_tokens": 8,
                          "finish_reason": "length", "latency_s": 1.0, "first_token_s": 0.1,
                          "decode_tokens_per_s": 8.0}],
            "steps": steps,
            "engine_stats": {"num_steps": len(steps), "mean_batch_size": c, "max_batch_size": c,
                             "num_preemptions": 0, "max_kv_blocks_used": 1,
                             "prefix_cache_hit_rate": 0.0,
                             "spec_decode": {"num_drafts": 0, "num_draft_tokens": 0,
                                             "num_accepted_tokens": 0}}}


def _runs():
    # C=1: a prompt step of 10 tokens, then 7 one-token steps; C=16: one prompt step of 160
    # tokens with 16 requests, then 7 decode steps of 16. Rep 1 runs at half the speed.
    out = []
    for rep, f in ((0, 1.0), (1, 0.5)):
        out.append(_run(rep, 1, 10.0 * f, [[0.1, 1, 10, 0, 0]] + [[0.1, 1, 1, 0, 0]] * 7))
        out.append(_run(rep, 16, 40.0 * f, [[0.5, 16, 160, 0, 0]] + [[0.1, 16, 16, 0, 0]] * 7))
    out.append({"mode": "plain", "rep": 0, "concurrency": 2, "error": "RuntimeError: x"})
    return out


def _floors(runs):
    env = {"peak_flops": 1e6, "peak_source": "test", "read_bandwidth_start": 1e4,
           "read_bandwidth_end": 2e4}
    cfg = ThroughputBenchConfig(dtype="bfloat16")
    return add_floors(runs, cfg, _arch(), env, cache_bytes=0)


def test_add_floors_and_the_bound_on_the_target():
    runs = _runs()
    info = _floors(runs)
    counts = MatmulCounts(**info["counts"])
    machine = Machine(**info["machine"])
    assert machine.bandwidth == 2e4  # the better of the two probes
    assert counts == MatmulCounts.from_arch(_arch(), 2.0)
    c1, c16 = runs[0], runs[1]
    # prompt steps put no rows through the head; decode steps put every row
    assert c1["floor_seconds"] == pytest.approx(
        step_floor_seconds(counts, machine, 10, 0) + 7 * step_floor_seconds(counts, machine, 1, 1))
    assert c16["floor_seconds"] == pytest.approx(
        run_floor_seconds(counts, machine, [(160, 0)] + [(16, 16)] * 7))
    assert "floor_seconds" not in runs[-1]  # failed runs have none
    t = target_line(runs, 16, 6.0)
    # per repetition: C=16 at its floor over C=1 as measured (rep 1's C=1 is half as fast)
    at_floor = c16["num_output_tokens"] / c16["floor_seconds"]
    assert t["ceiling_ratio"] == pytest.approx(statistics.median(
        [at_floor / 10.0, at_floor / 5.0]))
    assert t["roofline_ratio"] == pytest.approx(
        at_floor / (c1["num_output_tokens"] / c1["floor_seconds"]))
    rows = aggregate(runs)
    row16 = next(r for r in rows if r["concurrency"] == 16)
    assert row16["floor_fraction"] == pytest.approx(statistics.median(
        [c16["floor_seconds"] / r["wall_seconds"] for r in runs[1:4:2]]))


def test_report_states_the_bound_only_with_floors():
    runs = _runs()
    info = _floors(runs)
    results = {"config": dataclasses.asdict(ThroughputBenchConfig(dtype="bfloat16")),
               "environment": {"torch_num_threads": 1, "cpu_count": 2,
                               "load_average_start": 0.0, "load_average_end": 0.0,
                               "floor": info},
               "prompts": [{"dataset": "mt_bench", "category": "writing", "num_tokens": 10}],
               "rows": aggregate(runs), "ratios": ratios(runs), "target": target_line(runs),
               "slowest_steps": slowest_steps(runs), "runs": runs, "total_seconds": 1.0}
    t = results["target"]
    text = bound_sentence(results)
    assert f"**{t['ceiling_ratio']:.2f}x**" in text and "GFLOP/s, test)" in text
    assert f"{100 * 6.0 / t['ceiling_ratio']:.0f}% of the cap" in text
    assert "C=16 plain ran at" in text and text in markdown(results)
    del results["environment"]["floor"]
    assert bound_sentence(results) == "" and "**Bound**" not in markdown(results)


def test_probes():
    assert roofline._parse_size("32768K") == 32 << 20
    assert roofline._parse_size("1M") == 1 << 20 and roofline._parse_size("512") == 512
    assert roofline.last_level_cache_bytes() >= 0
    rate, source = roofline.measure_peak_flops(torch.bfloat16)
    assert rate > 1e9 and source


def test_peak_falls_back_to_matmuls(monkeypatch):
    monkeypatch.setattr(peak, "vector_peak_flops", lambda **kw: None)
    rate, source = roofline.measure_peak_flops(torch.float32)
    assert rate > 1e8 and "1024x1024 float32 matmuls" in source


def test_vector_peak_kernel():
    if peak._lazy.get() is None:
        pytest.skip(f"peak kernel unavailable: {peak._lazy.unavailable}")
    assert peak.vector_peak_flops(bf16=True, num_threads=1, iters=100_000, repeats=2) > 1e9
    assert peak.vector_peak_flops(bf16=False, num_threads=1, iters=100_000, repeats=2) > 1e9
    assert peak.vector_peak_flops(bf16=True, iters=0) is None
