# Record of commit d260f3d: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at d260f3d`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""A/B of the adaptive policy with and without its realized check (`spec_decode.realized`)
against plain decoding, on one target and draft at C requests in flight: N requests x T
tokens, REPS repetitions, the engines' order rotated every repetition. Prints each engine's
wall seconds per repetition, min / median and ratios to plain (paired-med: the median of the
per-repetition ratios), then the adaptive engines' realized factor per batch size (as seen
at the end) and their K histograms.

    [MODEL=qwen2.5-coder-1.5b-moe] [DRAFT=qwen2.5-coder-0.5b|ngram] [DQ=int4] [K=4] \
    [AA=1: plain2, an A/A control] [STATIC=1: static K] [MIXED=1: HumanEval + translation] \
    python docs/results/2026-12-06-realized-check/ab.py C REPS N T
"""
import collections
import dataclasses
import os
import statistics
import sys
import time

from specmoe import LLM
from specmoe.bench.throughput import ThroughputBenchConfig, _run_wave, build_prompts, warm_up
from specmoe.utils.gc_heap import frozen_heap

MODEL = os.environ.get("MODEL", "qwen2.5-coder-1.5b-moe")
DRAFT = os.environ.get("DRAFT", "qwen2.5-coder-0.5b")
C, REPS, N, T = (int(x) for x in sys.argv[1:5])
K = int(os.environ.get("K", "4"))
llm = LLM(MODEL, dtype="bfloat16", scheduler={"max_num_seqs": 64})
extra = ({"datasets": ["humaneval", "spec_bench"], "spec_bench_categories": ["translation"]}
         if os.environ.get("MIXED") else {})
cfg = ThroughputBenchConfig(model=MODEL, num_requests=max(N, 8), concurrency=[C],
                            max_tokens=T, **extra)
prompts = build_prompts(cfg, llm)[:N]
base = ({"method": "ngram", "num_speculative_tokens": K} if DRAFT == "ngram" else
        {"method": "draft", "draft_model": DRAFT, "num_speculative_tokens": K,
         "draft_quantization": os.environ.get("DQ", "int4") or None})
engines = {"plain": llm,
           **({"plain2": llm.with_speculative(None)} if os.environ.get("AA") else {}),
           "adaptive": llm.with_speculative({**base, "policy": "adaptive"}),
           "nocheck": llm.with_speculative({**base, "policy": "adaptive"})}
if os.environ.get("STATIC"):
    engines["static"] = llm.with_speculative(base)
pol = engines["nocheck"].engine.policy
pol.s = dataclasses.replace(pol.s, realized_check=False)
warm_up(engines, prompts)
times = collections.defaultdict(list)
names = list(engines)
with frozen_heap():
    for rep in range(REPS):
        for n in names[rep % len(names):] + names[:rep % len(names)]:
            t = time.perf_counter()
            _run_wave(engines[n], prompts, list(range(N)), T, C)
            times[n].append(time.perf_counter() - t)
        print(rep, {n: round(times[n][-1], 2) for n in names}, flush=True)
for n in names:
    lo, med = min(times[n]), statistics.median(times[n])
    print(f"{n:9s} min {lo:.3f} med {med:.3f}  plain/x min {min(times['plain']) / lo:.3f} "
          f"med {statistics.median(times['plain']) / med:.3f} paired-med "
          f"{statistics.median(p / x for p, x in zip(times['plain'], times[n])):.3f}")
for n in ("adaptive", "nocheck"):
    p = engines[n].engine.policy
    print(n, "factor", {b: round(p.realized.factor(b), 3) for b in sorted(p.realized._on)},
          "draft_ks", engines[n].engine.stats.draft_k_histogram)
