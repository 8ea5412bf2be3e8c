"""One engine on one GGUF file, in this process: what `specmoe bench peers` measures per run.

    python -m specmoe.analysis.peer_probe {specmoe,llama-cpp} FILE.gguf [options]

Prints one JSON line: load seconds (engine construction), prefill tokens/s (CONTEXT tokens
in one call), Tt(1, T) for T = 1..MAX_T (one forward of T new tokens after the context,
median of `--reps` after 2 warm-ups), decode tokens/s (`--decode-tokens` single-token
forwards after the context), peak RSS (ru_maxrss), the read-bandwidth probe, and for
specmoe on a MoE the distinct experts each T touched per layer under the file's own router.
Token ids are seeded random ids: the same in both engines.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import numpy as np

ENGINES = ("specmoe", "llama-cpp")


def token_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    """n seeded ids in [min(100, vocab // 2), vocab) (past the usual special tokens)."""
    return np.random.default_rng(seed).integers(min(100, vocab // 2), vocab, n).tolist()


def _median_after_warmup(timed, reps: int) -> float:
    """Median of `reps` calls of `timed` (returns seconds) after 2 untimed ones."""
    return statistics.median([timed() for _ in range(reps + 2)][2:])


def probe_specmoe(a) -> dict:
    from specmoe.analysis.verify_cost import VerifyCostBench
    from specmoe.config import ModelConfig
    from specmoe.loader.model_loader import load_model
    from specmoe.worker.model_runner import ModelRunner, SequenceInput
    t0 = time.perf_counter()
    runner = ModelRunner(load_model(ModelConfig(
        a.file, quantization=a.quantization, max_model_len=a.context + a.extra)))
    load_s = time.perf_counter() - t0
    ids = token_ids(runner.vocab_size, a.context + a.extra)
    t0 = time.perf_counter()  # the constructor prefills the context in one forward
    bench = VerifyCostBench(runner, context_len=a.context, max_batch_size=1,
                            max_num_tokens=a.extra, token_windows=[ids])
    prefill_s = time.perf_counter() - t0
    tt, unique = {}, {}
    for t in range(1, a.max_t + 1):
        tt[t] = _median_after_warmup(lambda: bench.time_forward(1, t)[0], a.reps)
        if bench.blocks:
            unique[t] = round(float(np.mean(bench.unique_experts(1, t))), 2)
    blocks = list(range(bench.blocks_per_seq))
    t0 = time.perf_counter()
    for i in range(a.decode_tokens):
        pos = a.context + i
        runner.execute(bench.cache, [SequenceInput([ids[pos]], pos, blocks, 1)])
    decode_s = time.perf_counter() - t0
    return {"load_s": load_s, "prefill_s": prefill_s, "tt": tt, "decode_s": decode_s,
            "unique_experts": unique}


def probe_llama_cpp(a) -> dict:
    from specmoe.bench.llamacpp_peer import import_llama_cpp
    llama_cpp = import_llama_cpp()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(a.file, n_ctx=a.context + a.extra + 16, n_batch=a.context,
                          n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    load_s = time.perf_counter() - t0
    ids = token_ids(llm.n_vocab(), a.context + a.extra)
    t0 = time.perf_counter()
    llm.eval(ids[:a.context])
    prefill_s = time.perf_counter() - t0

    def verify(t: int) -> float:
        llm.n_tokens = a.context  # eval() drops the cache past n_tokens first
        start = time.perf_counter()
        llm.eval(ids[a.context:a.context + t])
        return time.perf_counter() - start
    tt = {t: _median_after_warmup(lambda: verify(t), a.reps) for t in range(1, a.max_t + 1)}
    llm.n_tokens = a.context
    t0 = time.perf_counter()
    for i in range(a.decode_tokens):
        llm.eval([ids[a.context + i]])
    decode_s = time.perf_counter() - t0
    return {"load_s": load_s, "prefill_s": prefill_s, "tt": tt, "decode_s": decode_s,
            "unique_experts": {}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specmoe.analysis.peer_probe")
    p.add_argument("engine", choices=ENGINES)
    p.add_argument("file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-t", type=int, default=9)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--probe-bytes", type=int, default=1 << 30)
    a = p.parse_args(argv)
    a.extra = max(a.max_t, a.decode_tokens)
    import torch
    torch.set_num_threads(a.threads)
    from specmoe.bench.roofline import measure_read_bandwidth
    out = probe_specmoe(a) if a.engine == "specmoe" else probe_llama_cpp(a)
    out.update(engine=a.engine, threads=a.threads, context=a.context,
               prefill_tok_s=a.context / out["prefill_s"],
               decode_tok_s=a.decode_tokens / out["decode_s"] if a.decode_tokens else None,
               peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
               probe_gbs=measure_read_bandwidth(a.probe_bytes) / 1e9)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
