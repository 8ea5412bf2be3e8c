"""A/B of one-row software prefetch in the bf16 panel kernels (`kernels.panel_prefetch`): the
same engines with it off and on, at C requests in flight, N requests x T tokens, REPS
repetitions in rotated order (`specmoe.bench.ab`). Prints what the load-time tune chose and
measured, the memory read bandwidth before and after, each variant's wall seconds and its
ratio to plain decoding with prefetch off.

    MODEL=smollm2-135m [DRAFT=ngram|qwen2.5-coder-0.5b] [DQ=int4] [K=8] \
    [POLICIES=adaptive,static:4] [MIXED=1: HumanEval + translation] \
    python docs/results/2026-12-06-one-row-prefetch/ab.py C REPS N T
"""
import os
import sys

from specmoe import LLM
from specmoe.bench.ab import rotated, summary
from specmoe.bench.roofline import PROBE_BYTES, measure_read_bandwidth
from specmoe.bench.throughput import ThroughputBenchConfig, _run_wave, build_prompts, warm_up
from specmoe.kernels import panel_prefetch
from specmoe.utils.gc_heap import frozen_heap

MODEL = os.environ.get("MODEL", "smollm2-135m")
DRAFT = os.environ.get("DRAFT")
C, REPS, N, T = (int(x) for x in sys.argv[1:5])
K = int(os.environ.get("K", "8"))
llm = LLM(MODEL, dtype="bfloat16", scheduler={"max_num_seqs": 64})
print("tune", panel_prefetch.state(), flush=True)
extra = ({"datasets": ["humaneval", "spec_bench"], "spec_bench_categories": ["translation"]}
         if os.environ.get("MIXED") else {})
cfg = ThroughputBenchConfig(model=MODEL, num_requests=max(N, 8), concurrency=[C],
                            max_tokens=T, **extra)
prompts = build_prompts(cfg, llm)[:N]
engines = {"plain": llm}
if DRAFT:
    base = ({"method": "ngram"} if DRAFT == "ngram" else
            {"method": "draft", "draft_model": DRAFT,
             "draft_quantization": os.environ.get("DQ", "int4") or None})
    for policy in os.environ.get("POLICIES", "adaptive").split(","):
        name, _, k = policy.partition(":")
        engines[policy] = llm.with_speculative(
            {**base, "num_speculative_tokens": int(k or K),
             **({"policy": "adaptive"} if name == "adaptive" else {})})
warm_up(engines, prompts)


def run(engine, on):
    def go():
        panel_prefetch.set_enabled(on)
        _run_wave(engine, prompts, list(range(N)), T, C)
    return go


runs = {f"{name} {'on' if on else 'off'}": run(e, on) for name, e in engines.items()
        for on in (False, True)}
bw = measure_read_bandwidth(PROBE_BYTES, repeats=3)
with frozen_heap():
    times = rotated(runs, REPS, lambda r, t: print(r, {n: round(s, 2) for n, s in t.items()},
                                                   flush=True))
print(f"read bandwidth {bw / 1e9:.1f} -> "
      f"{measure_read_bandwidth(PROBE_BYTES, repeats=3) / 1e9:.1f} GB/s")
print("\n".join(summary(times, "plain off")))
