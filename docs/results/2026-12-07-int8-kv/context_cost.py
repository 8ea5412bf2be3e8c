"""Decode-step time against context length, float32 and int8 KV caches, on one target.

    python context_cost.py TARGET.gguf [CONTEXTS] [REPS]

The target runs at its file's blocks (`quantization="gguf"`, float32 activations). For each
context length C (default 512,2048,8192,16384), each cache dtype's cache is filled with C
random key/value rows per layer (attention's cost does not depend on the values), then one
decode forward (1 token at position C) is timed, the dtypes interleaved, REPS times (default
9); prints one JSON line per (C, dtype): the median and min seconds, the KV bytes the step
reads, and the run's read-bandwidth probe (GB/s, best of 5 sums of 256 MiB).
"""
import json
import statistics
import sys
import time

import torch

from specmoe import LLM
from specmoe.worker.kv_cache import kv_bytes_per_token
from specmoe.worker.model_runner import SequenceInput

BLOCK = 16
DTYPES = ("float32", "int8")


def bandwidth_gbs() -> float:
    a = torch.ones(64 << 20)
    best = min(_timed(a.sum) for _ in range(5))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def filled_cache(runner, dtype: str, context: int):
    """A cache of context + 1 positions whose first `context` hold random rows."""
    cache = runner.new_paged_cache(-(-(context + 1) // BLOCK), BLOCK, dtype)
    arch = runner.arch
    g = torch.Generator().manual_seed(0)
    for start in range(0, context, 4096):
        n = min(4096, context - start)
        slots = torch.arange(start, start + n)
        for layer in cache.layers:
            k, v = (torch.randn(n, arch.num_key_value_heads, arch.head_dim, generator=g)
                    for _ in range(2))
            layer.write(k, v, slots)
    return cache


def main() -> None:
    target = sys.argv[1]
    contexts = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else
                                 "512,2048,8192,16384").split(",")]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 9
    llm = LLM(target, quantization="gguf")
    runner = llm.target
    probe = bandwidth_gbs()
    for context in contexts:
        caches = {d: filled_cache(runner, d, context) for d in DTYPES}
        times = {d: [] for d in DTYPES}
        for _ in range(reps + 1):  # the first round warms up
            for d in DTYPES:
                seq = SequenceInput([17], context, list(range(caches[d].num_blocks)), 1)
                times[d].append(_timed(lambda: runner.execute(caches[d], [seq])))
        for d in DTYPES:
            kv = runner.kv_dtype(d)
            print(json.dumps({
                "context": context, "kv_cache_dtype": d,
                "median_s": round(statistics.median(times[d][1:]), 5),
                "min_s": round(min(times[d][1:]), 5),
                "kv_bytes_read": kv_bytes_per_token(runner.arch, kv) * (context + 1),
                "probe_gbs": round(probe, 1)}), flush=True)
        del caches


if __name__ == "__main__":
    main()
