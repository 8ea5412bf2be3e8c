"""One engine in a fresh process: load time, peak RSS, greedy decode tok/s on four prompts.

    python decode.py TARGET.gguf MODE [DRAFT.gguf|ngram] [K]
MODE: "gguf" (the file's blocks) or "none" (dequantised to float32). Prints one JSON line.
"""
import hashlib
import json
import resource
import sys
import time

import torch

from specmoe import LLM
from specmoe.sampling_params import SamplingParams

PROMPTS = ["def quicksort(items):", "Write a Python function that checks whether a string is a "
           "palindrome.", "class LinkedList:\n    def __init__(self):",
           "# Compute the n-th Fibonacci number iteratively\ndef fib(n):"]


def bandwidth_gbs() -> float:
    a = torch.ones(64 << 20)  # 256 MiB float32
    best = min(_timed(a.sum) for _ in range(5))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    target, mode = sys.argv[1], sys.argv[2]
    draft = sys.argv[3] if len(sys.argv) > 3 else None
    k = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    q = None if mode == "none" else mode
    spec = None
    if draft == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k}
    elif draft:
        spec = {"method": "draft", "draft_model": draft, "num_speculative_tokens": k,
                "draft_quantization": q}
    t0 = time.perf_counter()
    llm = LLM(target, quantization=q, speculative=spec)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=128)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    tokens, seconds, texts = 0, 0.0, []
    for p in PROMPTS:  # one at a time: batch 1
        t0 = time.perf_counter()
        out = llm.generate([p], params)[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
        texts.append(out.text)
    print(json.dumps({"mode": mode, "draft": draft, "k": k if spec else 0,
                      "load_s": round(load_s, 1), "tok_s": round(tokens / seconds, 2),
                      "tokens": tokens, "peak_rss_gb": round(
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
                      "probe_gbs": round(bandwidth_gbs(), 1), "text_sha": hashlib.sha256(str(texts).encode()).hexdigest()[:12]}))


if __name__ == "__main__":
    main()
