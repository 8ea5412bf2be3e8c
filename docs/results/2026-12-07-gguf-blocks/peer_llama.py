"""llama.cpp (llama-cpp-python, `make peers`) on the same prompts as decode.py, one fresh
process: load time, peak RSS, greedy decode tok/s, plain or with prompt lookup.

    python peer_llama.py TARGET.gguf [lookup]
"""
import hashlib
import json
import resource
import sys
import time

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from decode import PROMPTS, bandwidth_gbs


def main() -> None:
    path, lookup = sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "lookup"
    draft = LlamaPromptLookupDecoding(num_pred_tokens=4) if lookup else None
    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_threads=2, n_ctx=1024, verbose=False, seed=0,
                draft_model=draft)
    load_s = time.perf_counter() - t0
    llm("def f(x):", max_tokens=8, temperature=0)  # warm-up
    tokens, seconds, texts = 0, 0.0, []
    for p in PROMPTS:
        t0 = time.perf_counter()
        out = llm(p, max_tokens=128, temperature=0)
        seconds += time.perf_counter() - t0
        tokens += out["usage"]["completion_tokens"]
        texts.append(out["choices"][0]["text"])
    print(json.dumps({"mode": "llama.cpp", "draft": "lookup" if lookup else None,
                      "load_s": round(load_s, 1), "tok_s": round(tokens / seconds, 2),
                      "tokens": tokens, "peak_rss_gb": round(
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
                      "probe_gbs": round(bandwidth_gbs(), 1),
                      "text_sha": hashlib.sha256(str(texts).encode()).hexdigest()[:12]}))


if __name__ == "__main__":
    main()
