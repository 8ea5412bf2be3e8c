# Record of commit 81b4dc1: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at 81b4dc1`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""A/B on the mixed workload (SmolLM2, prompt lookup K <= 8, half HumanEval, half Spec-Bench
translation) at one C, the bench's balanced 0.1 s turns: plain, plain2 (A/A), static:1,
adaptive, and adaptive variants: z0 (the realized check's point value, as before this stop),
noshadow (no shadow drafts for held requests). Per repetition: x plain, the share of steps
with speculation off, steps, realized factors below 0.995; then medians and ranges.

Usage: python ab_z.py C REPS [NUM_REQUESTS=16] [RANGE_RATIO=0] [VARIANTS=z0]"""
import sys
import numpy as np
from specmoe.bench.throughput import (ThroughputBenchConfig, build_engines, add_speculative_engines,
    build_prompts, workload_kv_blocks, warm_up, fitting_prompts, policy_speculative,
    assign_output_lengths)
from specmoe.bench.throughput_run import run_interleaved
from specmoe.utils.gc_heap import frozen_heap
argv = sys.argv[1:] + [None] * 5
C, reps = int(argv[0]), int(argv[1])
n, ratio = int(argv[2] or 16), float(argv[3] or 0.0)
variants = (argv[4] or "z0").split(",")
cfg = ThroughputBenchConfig(model="smollm2-135m", draft="ngram", policies=["static:1", "adaptive"],
    num_speculative_tokens=8, concurrency=[C], max_tokens=48, num_requests=n, dtype="bfloat16",
    aa_control=True, datasets=["humaneval", "spec_bench"], spec_bench_categories=["translation"],
    max_tokens_range_ratio=ratio)
engines = build_engines(cfg)
prompts, _ = fitting_prompts(build_prompts(cfg, engines["plain"]), cfg.output_len_range[1],
                             engines["plain"].max_model_len)
assign_output_lengths(prompts, cfg)
kv = workload_kv_blocks(cfg, prompts, engines["plain"].config.scheduler.block_size)
add_speculative_engines(cfg, engines, kv)
for v in variants:
    engines[f"adaptive_{v}"] = e = engines["plain"].with_speculative(
        {"method": "ngram"} | policy_speculative("adaptive", 8, None), kv)
    if v == "z0":
        e.engine.policy.realized.z = 0.0
    elif v == "noshadow":
        e.engine.shadow = None
    else:
        raise SystemExit(f"unknown variant {v}")
warm_up(engines, prompts)
modes = list(engines)
res = {m: [] for m in modes}
with frozen_heap():
    for rep in range(reps):
        done = run_interleaved(engines, modes, prompts, C, cfg.max_tokens, cfg.num_requests,
                               arrival="closed", start=rep, slice_seconds=0.1)
        for m in modes:
            res[m].append(done[m]["tokens_per_s"])
        stats = {m: done[m]["engine_stats"] for m in modes}
        print(rep, {m: (round(res[m][-1] / res["plain"][-1], 3),
                        round(stats[m]["num_spec_paused_steps"] / stats[m]["num_steps"], 2),
                        stats[m]["num_steps"],
                        {k: round(v, 2) for k, v in stats[m].get("realized_gain_factors", {}).items()
                         if v < 0.995})
                    for m in modes}, flush=True)
for m in modes:
    r = np.array(res[m]) / np.array(res["plain"])
    print(m, "median x plain", round(float(np.median(r)), 3),
          "range", round(float(r.min()), 3), round(float(r.max()), 3))
