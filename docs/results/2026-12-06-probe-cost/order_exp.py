"""Is adaptive's deficit at C requests on tiny-moe the engine's, or the bench's? Runs the
bench's nine modes and plain3, a plain engine built after all speculative ones with their KV
cache size, 64 requests in waves of C, interleaved in turns of $SLICE seconds (default
0.5), and prints each
repetition's tokens/s over plain. Usage: SLICE=0.1 python order_exp.py 16 4"""
import os
import sys
import numpy as np
from specmoe.bench.throughput import (ThroughputBenchConfig, build_engines, add_speculative_engines,
    build_prompts, workload_kv_blocks, warm_up, fitting_prompts)
from specmoe.bench.throughput_run import run_interleaved
from specmoe.utils.gc_heap import frozen_heap
C, reps = int(sys.argv[1]), int(sys.argv[2])
cfg = ThroughputBenchConfig(model="tiny-moe", draft="tiny-moe-draft",
    policies=["static:1", "static:2", "static:4", "static:8", "table", "adaptive"],
    batch_size_table={"1-4": 4, "5-16": 2, "17-4096": 0},
    num_speculative_tokens=8, concurrency=[C], max_tokens=128, num_requests=64, dtype="bfloat16",
    aa_control=True)
engines = build_engines(cfg)
prompts, _ = fitting_prompts(build_prompts(cfg, engines["plain"]), cfg.max_tokens, engines["plain"].max_model_len)
kv = workload_kv_blocks(cfg, prompts, engines["plain"].config.scheduler.block_size)
add_speculative_engines(cfg, engines, kv)
engines["plain3"] = engines["plain"].with_speculative(None, kv)
warm_up(engines, prompts)
modes = list(engines)
print("modes", modes)
res = {m: [] for m in modes}
with frozen_heap():
    for rep in range(reps):
        done = run_interleaved(engines, modes, prompts, C, cfg.max_tokens, cfg.num_requests,
                               start=rep, slice_seconds=float(os.environ.get("SLICE", "0.5")))
        for m in modes:
            res[m].append(done[m]["tokens_per_s"])
        print(rep, {m: round(res[m][-1] / res["plain"][-1], 3) for m in ("plain2", "adaptive", "plain3")}, flush=True)
for m in ("plain2", "adaptive", "plain3"):
    r = np.array(res[m]) / np.array(res["plain"])
    print(m, "median x plain", round(float(np.median(r)), 3), "min", round(float(r.min()), 3))
