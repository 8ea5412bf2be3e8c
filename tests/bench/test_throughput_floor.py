"""The throughput bench's floor: matmul counts from an architecture, the runs' floors and
the bound they put on the scaling target, and the peak probes behind it."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
from kernel_checks import require_kernel
import torch

from specmoe.bench import roofline
from specmoe.bench.throughput import ThroughputBenchConfig, add_floors
from specmoe.bench.throughput_stats import aggregate, ratios, slowest_steps, target_line
from specmoe.bench.throughput_floor import MatmulCounts, run_floor_seconds
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
    c = MatmulCounts.from_arch(arch)
    assert c.head_params == 49152 * 576
    assert c.body_params + c.head_params + 61 * 576 == 134_515_008


def test_moe_counts_only_top_k_experts():
    moe = MoEConfig(num_experts=8, top_k=2, moe_intermediate_size=3, norm_topk_prob=True,
                    shared_expert_intermediate_size=5, has_shared_expert_gate=True,
                    moe_layers=[1])
    c = MatmulCounts.from_arch(_arch(moe=moe))
    attn = 4 * (4 + 2 * 2) + 4 * 4
    dense_layer = attn + 3 * 4 * 8
    moe_layer = attn + 4 * 8 + (3 * 4 * 5 + 4) + 2 * 3 * 4 * 3  # router, shared + gate, 2 experts
    assert c.body_params == dense_layer + moe_layer and c.head_params == 40


def test_floor_counts_every_row_and_only_logit_rows_through_the_head():
    c = MatmulCounts(body_params=100, head_params=10)
    assert c.step_flops(64, 0) == 2 * 100 * 64
    assert c.step_flops(5, 5) == 2 * 110 * 5
    assert run_floor_seconds(c, 1000.0, [(64, 0), (5, 5)]) == pytest.approx(
        (12800 + 1100) / 1000)
    with pytest.raises(ValueError, match="peak_flops=0"):
        run_floor_seconds(c, 0.0, [(1, 1)])


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
    # [seconds, requests, tokens, drafts, preempted, logit rows]. C=1: a prompt chunk that
    # does not end the prompt (1 token, no logits), the prompt's end, then one-token steps;
    # C=16: a prompt step whose last 4 requests end their prompts, then verifications of 2
    # drafts each (3 logit rows per request). Rep 1 runs at 0.4x the speed at C=16 and 0.5x
    # at C=1, so the ratios differ between repetitions.
    out = []
    for rep, (f1, f16) in enumerate(((1.0, 1.0), (0.5, 0.4))):
        out.append(_run(rep, 1, 10.0 * f1, [[0.1, 1, 1, 0, 0, 0], [0.1, 1, 9, 0, 0, 1]]
                        + [[0.1, 1, 1, 0, 0, 1]] * 7))
        out.append(_run(rep, 16, 40.0 * f16, [[0.5, 16, 160, 0, 0, 4]]
                        + [[0.1, 16, 48, 32, 0, 48]] * 3))
    out.append({"mode": "plain", "rep": 0, "concurrency": 2, "error": "RuntimeError: x"})
    out.append(_run(0, 4, 1.0, [[0.1, 4, 4, 0, 0]]))  # steps recorded before num_logits
    return out


def test_add_floors_and_the_bound_on_the_target():
    runs = _runs()
    assert add_floors(runs, _arch(), 1e6) == dataclasses.asdict(MatmulCounts.from_arch(_arch()))
    c = MatmulCounts.from_arch(_arch())
    c1, c16 = runs[0], runs[1]
    assert c1["floor_seconds"] == pytest.approx(
        (c.step_flops(1, 0) + c.step_flops(9, 1) + 7 * c.step_flops(1, 1)) / 1e6)
    assert c16["floor_seconds"] == pytest.approx(
        (c.step_flops(160, 4) + 3 * c.step_flops(48, 48)) / 1e6)
    assert "floor_seconds" not in runs[4] and "floor_seconds" not in runs[5]
    t = target_line(runs, 16, 6.0)
    # per repetition: C=16 at its floor over C=1 as measured (10 and 5 tok/s)
    at_floor = c16["num_output_tokens"] / c16["floor_seconds"]
    assert t["ceiling_ratio"] == pytest.approx(statistics.median([at_floor / 10.0,
                                                                  at_floor / 5.0]))
    assert target_line(runs, 32, 6.0)["ceiling_ratio"] is None
    rows = aggregate(runs)
    row16 = next(r for r in rows if r["concurrency"] == 16)
    fractions = [r["floor_seconds"] / r["wall_seconds"] for r in (runs[1], runs[3])]
    assert fractions[0] != fractions[1]
    assert row16["floor_fraction"] == pytest.approx(statistics.median(fractions))
    assert next(r for r in rows if r["concurrency"] == 4)["floor_fraction"] is None


def test_report_states_the_bound_only_with_floors():
    runs = _runs()
    add_floors(runs, _arch(), 1e6)
    results = {"config": dataclasses.asdict(ThroughputBenchConfig(dtype="bfloat16")),
               "environment": {"torch_num_threads": 1, "cpu_count": 2,
                               "load_average_start": 0.0, "load_average_end": 0.0,
                               "peak_flops": 1e6, "peak_source": "test probe"},
               "prompts": [{"dataset": "mt_bench", "category": "writing", "num_tokens": 10}],
               "rows": aggregate(runs), "ratios": ratios(runs), "target": target_line(runs),
               "slowest_steps": slowest_steps(runs), "runs": runs, "total_seconds": 1.0}
    t = results["target"]
    text = bound_sentence(results)
    assert f"**{t['ceiling_ratio']:.2f}x**" in text and "GFLOP/s, test probe)" in text
    assert f"{100 * 6.0 / t['ceiling_ratio']:.0f}% of the cap" in text
    assert "C=16 plain ran at" in text and text in markdown(results)
    del results["environment"]["peak_flops"]  # results from before the floor
    assert bound_sentence(results) == "" and "**Bound**" not in markdown(results)


def test_probes_take_the_best_rate(monkeypatch):
    rate, source = roofline.measure_peak_flops(torch.bfloat16)
    assert rate > 1e8 and source  # bf16 matmul without native bf16 units is slow
    monkeypatch.setattr(peak, "vector_peak_flops", lambda **kw: 1e15)
    assert roofline.measure_peak_flops(torch.float32)[0] == 1e15


def test_peak_falls_back_to_matmuls(monkeypatch):
    monkeypatch.setattr(peak, "vector_peak_flops", lambda **kw: None)
    rate, source = roofline.measure_peak_flops(torch.float32)
    assert rate > 1e8 and "1024x1024" in source and "torch.matmul" in source


def test_vector_peak_kernel():
    require_kernel("peak kernel", peak._lazy.unavailable_reason())
    assert peak.vector_peak_flops(bf16=True, num_threads=1, iters=100_000, repeats=2) > 1e9
    assert peak.vector_peak_flops(bf16=False, num_threads=1, iters=100_000, repeats=2) > 1e9
    assert peak.vector_peak_flops(bf16=True, iters=0) is None
