"""A/B at C requests of adaptive (K <= 8 and K <= 4) against static K = 4 and plain decoding on
the mixed workload, whole runs in rotated order (`python .../ab_c1.py C REPS N T`)."""
import collections, statistics, sys, time
from specmoe import LLM
from specmoe.bench.throughput import ThroughputBenchConfig, _run_wave, build_prompts, warm_up
from specmoe.utils.gc_heap import frozen_heap
C, REPS, N, T = (int(x) for x in sys.argv[1:5])
llm = LLM("smollm2-135m", dtype="bfloat16", scheduler={"max_num_seqs": 64})
cfg = ThroughputBenchConfig(model="smollm2-135m", num_requests=max(N, 8), concurrency=[C], max_tokens=T,
                            datasets=["humaneval", "spec_bench"], spec_bench_categories=["translation"])
prompts = build_prompts(cfg, llm)[:N]
b = {"method": "ngram"}
engines = {"plain": llm,
           "adaptive8": llm.with_speculative({**b, "num_speculative_tokens": 8, "policy": "adaptive"}),
           "adaptive4": llm.with_speculative({**b, "num_speculative_tokens": 4, "policy": "adaptive"}),
           "static:4": llm.with_speculative({**b, "num_speculative_tokens": 4})}
warm_up(engines, prompts)
times = collections.defaultdict(list); names = list(engines)
with frozen_heap():
    for rep in range(REPS):
        for n in names[rep % len(names):] + names[:rep % len(names)]:
            t = time.perf_counter(); _run_wave(engines[n], prompts, list(range(N)), T, C)
            times[n].append(time.perf_counter() - t)
        print(rep, {n: round(times[n][-1], 2) for n in names}, flush=True)
for n in names:
    print(f"{n:9s} min {min(times[n]):.3f} med {statistics.median(times[n]):.3f} paired plain/x "
          f"{statistics.median(p / x for p, x in zip(times['plain'], times[n])):.3f} paired static4/x "
          f"{statistics.median(p / x for p, x in zip(times['static:4'], times[n])):.3f}")
for n in ("adaptive8", "adaptive4", "static:4"):
    s = engines[n].engine.stats
    print(n, "drafted", s.spec.num_draft_tokens, "accepted", s.spec.num_accepted_tokens, "trimmed", s.num_trimmed_draft_tokens, "steps", s.num_steps)
