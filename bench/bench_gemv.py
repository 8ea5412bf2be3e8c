"""Weight-read bandwidth (GB/s) of the CPU bf16 linear kernel against torch's `F.linear`, for
Qwen2.5-1.5B-shaped matrices at decode-sized inputs, then greedy decode tokens/s of the bf16
Qwen2.5-Coder-1.5B target with the kernel on and off.

Weights are cycled over enough distinct copies to exceed the last-level cache, so every call
reads from memory. Kernel, `F.linear` and a plain streaming read of the same bytes
(`torch.sum`) alternate within each repetition in one process; ratios are per repetition
and reported as min/median. End to end, each prompt runs with the kernel on and off back to
back, and the ratio is per pair. Memory read bandwidth is measured in the same run
(`specmoe.bench.roofline.measure_read_bandwidth`).

On a machine whose cores are busy with other processes, OpenMP's default spin-waiting
(GOMP) costs milliseconds per parallel region, for torch's kernels and ours alike; run with
OMP_WAIT_POLICY=passive there.

    python bench/bench_gemv.py [--rows 1,2,5,9] [--reps 5] [--min-bytes 256e6]
                               [--e2e-model qwen2.5-coder-1.5b] [--e2e-tokens 64]
                               [--e2e-reps 4] [--k 4] [--skip-micro] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from specmoe import kernels
from specmoe.kernels import gemv
from specmoe.bench.roofline import measure_read_bandwidth

# (name, in_features, out_features) of Qwen2.5-1.5B: hidden 1536, intermediate 8960.
SHAPES = [("qkv", 1536, 2048), ("o_proj", 1536, 1536), ("gate_up", 1536, 17920),
          ("down", 8960, 1536), ("lm_head", 1536, 151936)]


def stats(xs: list[float]) -> str:
    return f"{min(xs):5.2f}/{statistics.median(xs):5.2f}"


def time_pass(fn, x: torch.Tensor, weights: list[torch.Tensor], biases: list) -> float:
    """Seconds for one call on each weight copy, in order."""
    t = time.perf_counter()
    for w, b in zip(weights, biases):
        fn(x, w, b)
    return time.perf_counter() - t


def bench_shape(name: str, k: int, n: int, rows: list[int], args) -> None:
    """Kernel, F.linear and a plain streaming read (torch.sum over the same bytes) in turn,
    per repetition; the kernel's fraction of the streaming rate is per repetition too."""
    nbytes = n * k * 2
    copies = max(1, int(args.min_bytes // nbytes))
    block = torch.randn(copies * n, k).bfloat16()  # [copies * out, in]
    weights = list(block.split(n))
    biases = [torch.randn(n).bfloat16() if name == "qkv" else None for _ in range(copies)]
    stream = block.view(torch.float32)
    packed = [(w, gemv.pack_weight(w)) for w in weights]  # the kernel reads the packed copy
    kernel = lambda x, wp, b: kernels.try_linear_bf16(x, wp[0], b, wp[1])  # noqa: E731
    inputs = {"kernel": (kernel, packed), "torch": (F.linear, weights)}
    for t in rows:
        x = torch.randn(t, k).bfloat16()
        gbs = {"kernel": [], "torch": [], "stream": []}
        for fn, ws in inputs.values():
            time_pass(fn, x, ws, biases)
        for _ in range(args.reps):
            for label, (fn, ws) in inputs.items():
                gbs[label].append(nbytes * copies / time_pass(fn, x, ws, biases) / 1e9)
            start = time.perf_counter()
            stream.sum().item()
            gbs["stream"].append(nbytes * copies / (time.perf_counter() - start) / 1e9)
        ratio = [a / b for a, b in zip(gbs["kernel"], gbs["torch"])]
        frac = [a / b for a, b in zip(gbs["kernel"], gbs["stream"])]
        print(f"{name:8s} {k:5d}->{n:<6d} T={t:<2d} kernel {stats(gbs['kernel'])}  F.linear "
              f"{stats(gbs['torch'])}  stream {stats(gbs['stream'])} GB/s | kernel/F.linear "
              f"{stats(ratio)}x  kernel/stream {stats(frac)}", flush=True)


def timed_pair(llm, ids: list[int], k: int, max_tokens: int, first: bool) -> dict:
    """Greedy runs with the kernel on and off, back to back (`first` goes first).
    Returns {on: (token ids, tokens/s)}."""
    from specmoe.bench.peers import ours_generate
    out = {}
    for on in (first, not first):
        kernels.set_enabled(on)
        toks, secs = ours_generate(llm, ids, k, max_tokens)
        out[on] = (toks, len(toks) / secs)
    kernels.set_enabled(True)
    return out


def bench_e2e(args, bandwidth: float) -> None:
    """Pairs of on/off runs per prompt and repetition (alternating which goes first); the
    on/off ratio is taken per pair."""
    from specmoe import LLM
    from specmoe.bench.roofline import weight_bytes_per_token
    from specmoe.utils.data import load_prompts
    from specmoe.layers.linear import prepack_weights
    from specmoe.utils import hugepages
    kernels.set_enabled(False)  # loaded without packing, so the dense weights stay for "off"
    llm = LLM(args.e2e_model, dtype="bfloat16",
              speculative={"method": "ngram", "num_speculative_tokens": args.k})
    kernels.set_enabled(True)
    prepack_weights(llm.target.model)  # the kernel's copies beside them, all in huge pages
    hugepages.rehome_module(llm.target.model)
    bytes_per_token = weight_bytes_per_token(llm.target.model)
    prompts = [p.text for p in load_prompts("humaneval", args.e2e_prompts)]
    ids = [llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    for k in (0, args.k):
        timed_pair(llm, ids[0], k, 8, True)  # warm-up
        pairs = [timed_pair(llm, p, k, args.e2e_tokens, rep % 2 == 0)
                 for rep in range(args.e2e_reps) for p in ids]
        on, off = [p[True][1] for p in pairs], [p[False][1] for p in pairs]
        same = sum(p[True][0] == p[False][0] for p in pairs)
        print(f"e2e K={k}: kernel on {stats(on)} tok/s, off {stats(off)} tok/s, on/off "
              f"{stats([a / b for a, b in zip(on, off)])}x; identical greedy outputs "
              f"{same}/{len(pairs)}", flush=True)
        if k == 0:
            roof = max(bandwidth, measure_read_bandwidth()) / bytes_per_token
            print(f"  roofline {roof:.2f} tok/s ({bytes_per_token / 1e9:.2f} GB/token at the "
                  f"best bandwidth measured): on {max(on) / roof:.0%} (median "
                  f"{statistics.median(on) / roof:.0%}), off {max(off) / roof:.0%} (median "
                  f"{statistics.median(off) / roof:.0%})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,5,9")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-bytes", type=float, default=256e6,
                    help="bytes of weight copies cycled per shape (beyond the L3 cache)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--e2e-model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--e2e-prompts", type=int, default=2)
    ap.add_argument("--e2e-tokens", type=int, default=64)
    ap.add_argument("--e2e-reps", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    reason = kernels.kernel_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"kernel unavailable: {reason}")
    bandwidth = measure_read_bandwidth()
    print(f"{torch.get_num_threads()} threads (OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}); memory read bandwidth {bandwidth / 1e9:.1f} GB/s"
          f"; values are min/median over {args.reps} reps")
    if not args.skip_micro:
        rows = [int(r) for r in args.rows.split(",")]
        for name, k, n in SHAPES:
            if name in args.shapes.split(","):
                bench_shape(name, k, n, rows, args)
    if not args.skip_e2e:
        bench_e2e(args, bandwidth)


if __name__ == "__main__":
    main()
