# Record of commit a6ec4b3: this script reaches into the engine's and the adaptive policy's internals as they were then
# and runs only at that commit (`git worktree add /tmp/at a6ec4b3`); the policy is configured through public settings since 2026-12-07-policy-seam.
"""A/B of the adaptive policy with and without its match-length trim (`spec_decode.match_trim`)
against plain decoding and static K, on one target and draft at C requests in flight: N
requests x T tokens, REPS repetitions, the engines' order rotated every repetition. Prints
each engine's wall seconds per repetition, min / median and ratios to plain (paired-med: the
median of the per-repetition ratios), then the adaptive engines' trimmed drafts and K
histograms.

    [MODEL=smollm2-135m] [DRAFT=ngram|qwen2.5-coder-0.5b] [DQ=int4] [K=8] \
    [STATICS=4,8: static K engines] [MIXED=1: HumanEval + translation] \
    python docs/results/2026-12-06-hindsight-ceiling/ab.py C REPS N T
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

MODEL = os.environ.get("MODEL", "smollm2-135m")
DRAFT = os.environ.get("DRAFT", "ngram")
C, REPS, N, T = (int(x) for x in sys.argv[1:5])
K = int(os.environ.get("K", "8"))
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
           "adaptive": llm.with_speculative({**base, "policy": "adaptive"}),
           "notrim": llm.with_speculative({**base, "policy": "adaptive"})}
for k in filter(None, os.environ.get("STATICS", "4,8").split(",")):
    engines[f"static:{k}"] = llm.with_speculative({**base, "num_speculative_tokens": int(k)})
pol = engines["notrim"].engine.policy
pol.s = dataclasses.replace(pol.s, match_trim=False)
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
for n in ("adaptive", "notrim"):
    st = engines[n].engine.stats
    print(n, "trimmed", st.num_trimmed_draft_tokens, "drafted", st.spec.num_draft_tokens,
          "accepted", st.spec.num_accepted_tokens, "draft_ks", dict(sorted(st.draft_k_histogram.items())))
