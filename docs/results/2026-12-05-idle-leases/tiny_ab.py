# Record of commit 88226d1: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at 88226d1`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""A/B of engines on tiny-moe + its draft, many short alternations (the sweep's runs of 1-7 s
are too short to average the machine's memory phases out): wall seconds of N requests x 128
tokens at C in flight, REPS repetitions, the engines' order rotated every repetition.

    python docs/results/2026-12-05-idle-leases/tiny_ab.py C REPS N

plain2 is a second engine without speculation (the A/A control); adapt-nosample is adaptive
with routing never sampled."""
import collections
import statistics
import sys
import time

from specmoe import LLM
from specmoe.bench.throughput import ThroughputBenchConfig, _run_wave, build_prompts
from specmoe.utils.gc_heap import frozen_heap

C, REPS, N = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM("tiny-moe", dtype="bfloat16", scheduler={"max_num_seqs": 64})
cfg = ThroughputBenchConfig(model="tiny-moe", num_requests=64, concurrency=[C], max_tokens=128)
prompts = [p for p in build_prompts(cfg, llm) if len(p["token_ids"]) < 380][:N]
base = {"method": "draft", "draft_model": "tiny-moe-draft", "num_speculative_tokens": 8}
engines = {"plain": llm, "plain2": llm.with_speculative(None),
           "adaptive": llm.with_speculative({**base, "policy": "adaptive"}),
           "adapt-nosample": llm.with_speculative({**base, "policy": "adaptive"})}
engines["adapt-nosample"].engine.routing_sampler.every = 10**9
for e in engines.values():  # warm-up, and the adaptive policies calibrated
    _run_wave(e, prompts, list(range(N)), 128, C)
times = collections.defaultdict(list)
names = list(engines)
with frozen_heap():
    for rep in range(REPS):
        for n in names[rep % len(names):] + names[:rep % len(names)]:
            t = time.perf_counter()
            _run_wave(engines[n], prompts, list(range(N)), 128, C)
            times[n].append(time.perf_counter() - t)
for n in names:
    lo, med = min(times[n]), statistics.median(times[n])
    print(f"{n:9s} min {lo:.3f} med {med:.3f}  min-ratio plain/x "
          f"{min(times['plain']) / lo:.3f} med-ratio {statistics.median(times['plain']) / med:.3f}")
