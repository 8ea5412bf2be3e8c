# Record of commit c1edc10: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at c1edc10`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""A/B on the mixed workload (SmolLM2, prompt lookup K <= 8, half HumanEval, half Spec-Bench
translation, 48 tokens) or, with AB_MODEL=tiny-moe, on tiny-moe with its draft (128 tokens), or
with AB_MODEL=qwen, on the Qwen2.5-Coder pair (bf16 1.5B, int4 0.5B draft, K <= 4, 32 tokens;
static:2 for static:1) at one C, the bench's balanced 0.1 s turns: plain, plain2 (A/A), static:1,
adaptive, and adaptive variants: z0 (the realized check's point value), noshadow (no shadow
drafts for held requests), noprompt (drafts not re-priced beside a prompt chunk), mgN (min_gain N%)
(at 3edbe14 also flatprobe: the probes' share of the time not halved, reverted). Per
repetition: each adaptive engine's count of steps whose drafts were cut beside a prompt chunk;
x plain, the share of steps with speculation off, steps, realized factors below 0.995; then
medians and ranges. Run from this folder.

Usage: [AB_MODEL=tiny-moe|qwen] python ab_prompt.py C REPS [NUM_REQUESTS=16] [RANGE_RATIO=0]
[VARIANTS=z0]"""
import dataclasses
import os
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
TINY = os.environ.get("AB_MODEL") == "tiny-moe"
QWEN = os.environ.get("AB_MODEL") == "qwen"
K, STATIC = (4, "static:2") if QWEN else (8, "static:1")
workload = (dict(model="tiny-moe", draft="tiny-moe-draft", max_tokens=128) if TINY else
            dict(model="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b",
                 draft_quantization="int4", max_tokens=32) if QWEN else
            dict(model="smollm2-135m", draft="ngram", max_tokens=48,
                 datasets=["humaneval", "spec_bench"], spec_bench_categories=["translation"]))
cfg = ThroughputBenchConfig(policies=[STATIC, "adaptive"], num_speculative_tokens=K,
    concurrency=[C], num_requests=n, dtype="bfloat16", aa_control=True,
    max_tokens_range_ratio=ratio, **workload)
SPEC = ({"method": "draft", "draft_model": "tiny-moe-draft"} if TINY else
        {"method": "draft", "draft_model": workload["draft"], "draft_quantization": "int4"}
        if QWEN else {"method": "ngram"})
engines = build_engines(cfg)
prompts, _ = fitting_prompts(build_prompts(cfg, engines["plain"]), cfg.output_len_range[1],
                             engines["plain"].max_model_len)
assign_output_lengths(prompts, cfg)
kv = workload_kv_blocks(cfg, prompts, engines["plain"].config.scheduler.block_size)
add_speculative_engines(cfg, engines, kv)
for v in variants:
    engines[f"adaptive_{v}"] = e = engines["plain"].with_speculative(
        SPEC | policy_speculative("adaptive", K, None), kv)
    if v == "z0":
        e.engine.policy.realized.z = 0.0
    elif v.startswith("mg"):  # min_gain in percent, e.g. mg3
        e.engine.policy.s = dataclasses.replace(e.engine.policy.s, min_gain=int(v[2:]) / 100)
    elif v in ("noprompt", "nocut"):
        e.engine._cut_beside_prompts = lambda: None
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
        print(rep, {m: (e.engine.policy.prompt_cut_steps if e.engine.policy else None) for m, e in engines.items()})
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
