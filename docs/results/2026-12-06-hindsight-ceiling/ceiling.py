"""The hindsight ceiling (`specmoe.analysis.hindsight`) of choosing K per step, on the
prompts of `bench throughput` at one and two requests: the decode seconds of static K in
{1, 2, 4, 8} and of the best schedule of K in 0..8 known in advance, under step costs
measured here (Tt(B, T) on the prompts' own text, as `specmoe advise` measures them, plus
the engine's time per step outside the forward). With n-gram drafting it first prints, over
every output position, how often the j-th draft of a proposal was accepted by the length n
of the match it continues (`MatchLengthTrim`'s statistic).

    [MODEL=smollm2-135m] [DRAFT=ngram] [N=16] [T=48] [DATASETS=humaneval,spec_bench] \
    [CATS=translation] python docs/results/2026-12-06-hindsight-ceiling/ceiling.py
"""
import os

import numpy as np

from specmoe.analysis.advise import (AdviseConfig, _prompt_ids, measure_engine_steps)
from specmoe.analysis.hindsight import pair_seconds, single_seconds
from specmoe.analysis.model_card import draft_acceptor, ngram_acceptor
from specmoe.spec_decode.ngram import find_ngram_match
from specmoe.analysis.real_study import RealStudyConfig, measure_forwards
from specmoe.config import SpeculativeConfig
from specmoe.engine.llm_engine import LLM
from specmoe.sampling_params import SamplingParams

MODEL = os.environ.get("MODEL", "smollm2-135m")
DRAFT = os.environ.get("DRAFT", "ngram")
N, T, KMAX = int(os.environ.get("N", "16")), int(os.environ.get("T", "48")), 8
cfg = AdviseConfig(model=MODEL, draft=DRAFT, num_prompts=N, max_tokens=T, batch_sizes=[1, 2],
                   datasets=os.environ.get("DATASETS", "humaneval,spec_bench").split(","),
                   spec_bench_categories=os.environ.get("CATS", "translation").split(","),
                   reps=3, draft_quantization=os.environ.get("DQ") or None)
llm = LLM(MODEL, dtype="bfloat16", scheduler={"kv_cache_memory_bytes": 512 << 20})
prompts = _prompt_ids(llm, cfg)
outputs = [o.token_ids for o in llm.generate(prompts, SamplingParams(
    max_tokens=T, temperature=0.0, ignore_eos=True))]
if DRAFT == "ngram":
    spec = SpeculativeConfig(method="ngram")
    lookup = (spec.prompt_lookup_min, spec.prompt_lookup_max)
    acc = [ngram_acceptor(p, o, lookup) for p, o in zip(prompts, outputs)]
    td = 0.0
else:
    dl = llm.with_speculative({"method": "draft", "draft_model": DRAFT,
                               "draft_quantization": cfg.draft_quantization})
    acc = [draft_acceptor(dl.proposer.runner, p, o) for p, o in zip(prompts, outputs)]
if DRAFT == "ngram":
    by_n = {}
    for p, o in zip(prompts, outputs):
        for pos in range(1, len(o)):
            prop, n = find_ngram_match(p + o[:pos], *lookup, KMAX)
            a = 0
            while a < len(prop) and pos + a < len(o) and prop[a] == o[pos + a]:
                a += 1
            if n:
                by_n.setdefault(n, []).append(a)
    for n, acc_n in sorted(by_n.items()):
        arr = np.array(acc_n)
        print(f"match length {n}: {len(arr)} proposals, P(draft j accepted) j = 1..{KMAX}:",
              [round(float((arr >= j).mean()), 2) for j in range(1, KMAX + 1)])
windows = [p + o for p, o in zip(prompts, outputs)]
ctx = min(128, min(len(w) for w in windows) - KMAX - 1)
grid = RealStudyConfig(models=[MODEL], batch_sizes=[1, 2], num_tokens=list(range(1, KMAX + 2)),
                       e2e_batch_sizes=[1, 2], ks=list(range(1, KMAX + 1)), reps=3,
                       context_len=ctx)
tt = {}
for _ in range(2):  # the least of two passes: the first pass's first points ran cold
    for p in measure_forwards(llm.target, windows, grid, grid.num_tokens):
        tt[p["B"], p["T"]] = min(tt.get((p["B"], p["T"]), 1e9), p["min_s"])
if DRAFT != "ngram":
    td = {p["B"]: p["min_s"] for p in measure_forwards(dl.proposer.runner, windows, grid, [1])}
over = measure_engine_steps(llm, prompts, cfg, {b: tt[b, 1] for b in (1, 2)})
print("Tt(1,T) ms", [round(tt[1, t] * 1e3, 2) for t in range(1, KMAX + 2)])
print("Tt(2,T) ms", [round(tt[2, t] * 1e3, 2) for t in range(1, KMAX + 2)])
print("overhead ms", {b: round(v["overhead_s"] * 1e3, 2) for b, v in over.items()})


def draft_s(b, rows):
    """A draft model drafts K tokens one forward each (rows - b of them at most)."""
    return 0.0 if DRAFT == "ngram" else td[b] * max(rows - b, 0) / b


def step1(rows):
    return tt[1, rows] + over[1]["overhead_s"] + draft_s(1, rows)


def step2(rows):
    """Two requests' rows: Tt(2, rows / 2) interpolated between measured T."""
    ts = list(range(1, KMAX + 2))
    return (float(np.interp(rows / 2, ts, [tt[2, t] for t in ts])) + over[2]["overhead_s"]
            + draft_s(2, rows))


n = [len(o) for o in outputs]
plain1 = sum(step1(1) * (m - 1) for m in n)
print("\nC = 1: decode seconds (sum over requests), speedup over plain, over best static")
res1 = {f"static:{k}": sum(single_seconds(a, m, k, step1, static=True)[0]
                           for a, m in zip(acc, n)) for k in (1, 2, 4, 8)}
res1["hindsight"] = sum(single_seconds(a, m, KMAX, step1)[0] for a, m in zip(acc, n))
best1 = min(v for k, v in res1.items() if k != "hindsight")
for k, v in res1.items():
    print(f"  {k:10s} {v:7.3f} s  {plain1 / v:5.3f}x plain  {best1 / v:5.3f}x best static")
per_k = [min(single_seconds(a, m, k, step1, static=True)[0] for k in (0, 1, 2, 4, 8))
         for a, m in zip(acc, n)]
print(f"  per-request best static K (known in advance): {sum(per_k):.3f} s, "
      f"{best1 / sum(per_k):5.3f}x best static")
per_req = [(single_seconds(a, m, 8, step1, static=True)[0] / single_seconds(a, m, KMAX, step1)[0])
           for a, m in zip(acc, n)]
print("  hindsight over static:8 per request:", [round(x, 3) for x in per_req])
pairs = [(i, i + N // 2) for i in range(N // 2)]
plain2 = sum(pair_seconds((acc[i], acc[j]), (n[i], n[j]), 0, step2, step1) for i, j in pairs)
print(f"\nC = 2 (pairs {pairs[:2]}...; plain {plain2:.3f} s)")
res2 = {f"static:{k}": sum(pair_seconds((acc[i], acc[j]), (n[i], n[j]), k, step2, step1,
                                        static=True) for i, j in pairs) for k in (1, 2, 4, 8)}
res2["hindsight"] = sum(pair_seconds((acc[i], acc[j]), (n[i], n[j]), KMAX, step2, step1)
                        for i, j in pairs)
best2 = min(v for k, v in res2.items() if k != "hindsight")
for k, v in res2.items():
    print(f"  {k:10s} {v:7.3f} s  {plain2 / v:5.3f}x plain  {best2 / v:5.3f}x best static")
