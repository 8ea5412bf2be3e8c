"""Tt(1, T) / Tt(1, 1): one forward of T new tokens after a 512-token context, B = 1, in
specmoe (`--quantization gguf`) or llama.cpp (llama-cpp-python's batch decode), one fresh
process; median of 7 after 2 warm-ups per T. Prints one JSON line.

    python verify_cost.py FILE.gguf ours|llama.cpp
"""
import json
import statistics
import sys
import time

import torch

from decode import bandwidth_gbs

TS = [1, 2, 3, 5, 9]
CONTEXT = 512


def ours(path: str) -> dict[int, float]:
    from specmoe.analysis.verify_cost import VerifyCostBench
    from specmoe.config import ModelConfig
    from specmoe.loader.model_loader import load_model
    from specmoe.worker.model_runner import ModelRunner
    runner = ModelRunner(load_model(ModelConfig(path, quantization="gguf",
                                                max_model_len=CONTEXT + 16)))
    bench = VerifyCostBench(runner, context_len=CONTEXT, max_batch_size=1, max_num_tokens=max(TS))
    out = {}
    for t in TS:
        times = [bench.time_forward(1, t)[0] for _ in range(9)][2:]
        out[t] = statistics.median(times)
    return out


def peer(path: str) -> dict[int, float]:
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_threads=2, n_ctx=1024, n_batch=512, verbose=False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (CONTEXT + max(TS),), generator=gen).tolist()
    llm.eval(ids[:CONTEXT])
    out = {}
    for t in TS:
        times = []
        for _ in range(9):
            llm.n_tokens = CONTEXT  # eval() drops the cache past n_tokens first
            start = time.perf_counter()
            llm.eval(ids[CONTEXT:CONTEXT + t])
            times.append(time.perf_counter() - start)
        out[t] = statistics.median(times[2:])
    return out


def main() -> None:
    path, engine = sys.argv[1], sys.argv[2]
    times = ours(path) if engine == "ours" else peer(path)
    print(json.dumps({"engine": engine, "Tt_ms": {t: round(s * 1e3, 2) for t, s in times.items()},
                      "ratio": {t: round(s / times[1], 2) for t, s in times.items()},
                      "probe_gbs": round(bandwidth_gbs(), 1)}))


if __name__ == "__main__":
    main()
