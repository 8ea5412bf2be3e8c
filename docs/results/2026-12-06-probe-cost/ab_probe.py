# Record of commit c7f0438: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at c7f0438`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""A/B at C on the mixed workload (fixed 48 tokens): adaptive with this stop's probe pricing
against adaptive0, the same policy with the probes' verification not counted."""
import sys
import numpy as np
from specmoe.bench.throughput import (ThroughputBenchConfig, build_engines, add_speculative_engines,
    build_prompts, workload_kv_blocks, warm_up, fitting_prompts, policy_speculative)
from specmoe.bench.throughput_run import run_interleaved
from specmoe.utils.gc_heap import frozen_heap
C, reps = int(sys.argv[1]), int(sys.argv[2])
cfg = ThroughputBenchConfig(model="smollm2-135m", draft="ngram", policies=["static:1", "adaptive"],
    num_speculative_tokens=8, concurrency=[C], max_tokens=48, num_requests=16, dtype="bfloat16",
    aa_control=True, datasets=["humaneval", "spec_bench"], spec_bench_categories=["translation"])
engines = build_engines(cfg)
prompts, _ = fitting_prompts(build_prompts(cfg, engines["plain"]), cfg.max_tokens, engines["plain"].max_model_len)
kv = workload_kv_blocks(cfg, prompts, engines["plain"].config.scheduler.block_size)
add_speculative_engines(cfg, engines, kv)
engines["adaptive0"] = engines["plain"].with_speculative({"method": "ngram"} | policy_speculative("adaptive", 8, None), kv)
engines["adaptive0"].engine.policy._probe_excess = lambda rows, seconds: 0.0
warm_up(engines, prompts)
modes = list(engines)
res = {m: [] for m in modes}
with frozen_heap():
    for rep in range(reps):
        done = run_interleaved(engines, modes, prompts, C, cfg.max_tokens, cfg.num_requests,
                               arrival="closed", start=rep, slice_seconds=0.1)
        for m in modes:
            res[m].append(done[m]["tokens_per_s"])
        info = {m: (round(res[m][-1] / res["plain"][-1], 3),
                    round(done[m]["engine_stats"]["num_spec_paused_steps"] / done[m]["engine_stats"]["num_steps"], 2),
                    {k: round(v, 2) for k, v in done[m]["engine_stats"].get("realized_gain_factors", {}).items()})
                for m in modes if m != "plain"}
        print(rep, info, flush=True)
for m in modes:
    r = np.array(res[m]) / np.array(res["plain"])
    print(m, "median x plain", round(float(np.median(r)), 3), "range", round(float(r.min()), 3), round(float(r.max()), 3))
