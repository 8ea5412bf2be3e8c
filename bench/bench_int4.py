"""Time of the CPU int4 linear kernel (`specmoe.kernels.gemv_int4`) against torch's
`aten._weight_int4pack_mm_for_cpu` and our bf16 kernel, for Qwen2.5-0.5B-shaped matrices
(the draft model) at decode-sized inputs, or at prefill sizes with `--rows 64,150` (17-32
rows run as two int4 kernel calls; beyond 32 ours dequantises slices of the weights to bf16
for the bf16 GEMM, unless SPECMOE_INT4_BATCH_INVARIANT=1).

Each implementation cycles over distinct copies of its weights totalling at least
`--min-bytes` (default 512 MiB, far beyond the 32 MiB L3), so every call reads from memory.
The three alternate within each repetition in one process; the ratio to torch's int4 kernel
is taken per repetition, and min/median over repetitions are printed. Bandwidth counts the
bytes each implementation must read: int4 ones 0.5 byte per weight + 4 bytes (bf16 scale
and zero) per group of 32, the same for ours and torch's; bf16 2 bytes per weight. Weight
values are random (timing does not depend on them).

On a machine whose cores are busy with other processes, OpenMP's default spin-waiting
costs milliseconds per parallel region; run with OMP_WAIT_POLICY=passive there.

    python bench/bench_int4.py [--rows 1,2,4,8] [--reps 5] [--min-bytes 512MiB]
                               [--shapes q,kv,o,gate_up,down,head]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from specmoe import kernels
from specmoe.kernels import gemv, gemv_int4

# (name, in_features, out_features) of Qwen2.5-0.5B: hidden 896, intermediate 4864, vocab
# 151936 (the tied LM head); k and v are separate [128, 896] projections.
SHAPES = [("q", 896, 896), ("kv", 896, 128), ("o", 896, 896), ("gate_up", 896, 9728),
          ("down", 4864, 896), ("head", 896, 151936)]
GROUP = gemv_int4.GROUP_SIZE


def stats(xs: list[float], fmt: str = "6.2f") -> str:
    return f"{min(xs):{fmt}}/{statistics.median(xs):{fmt}}"


def int4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * (k // GROUP) * 4


def make_weights(n: int, k: int, min_bytes: float):
    """Copies of random int4 weights in both layouts and of bf16 weights, each list at least
    `min_bytes` in total. Returns (ours [Int4Weights], torch [(packed, sz)], bf16 [weight])."""
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)  # [out, in]
    sz = (torch.rand(k // GROUP, n, 2) * 0.01).bfloat16()  # [groups, out, 2]
    ours = gemv_int4.pack_int4(q, sz)  # what Int4Linear keeps, as an Int4Weights
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    copies = -(-int(min_bytes) // int4_bytes(n, k))
    ours_list = [gemv_int4.Int4Weights(*(t.clone() for t in ours)) for _ in range(copies)]
    theirs_list = [(theirs.clone(), sz.clone()) for _ in range(copies)]
    bf16 = torch.randn(n, k).bfloat16()
    bf16_list = [bf16.clone() for _ in range(-(-int(min_bytes) // (n * k * 2)))]
    return ours_list, theirs_list, bf16_list


def time_pass(fn, x: torch.Tensor, weights: list) -> float:
    """Seconds per call, over one call on each weight copy in order."""
    start = time.perf_counter()
    for w in weights:
        fn(x, w)
    return (time.perf_counter() - start) / len(weights)


def bench_shape(name: str, k: int, n: int, args) -> None:
    ours, theirs, bf16 = make_weights(n, k, args.min_bytes)
    fns = {
        "ours": (lambda x, w: w.linear(x), ours, int4_bytes(n, k)),
        "torch": (lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], GROUP, w[1]),
                  theirs, int4_bytes(n, k)),
        "bf16": (lambda x, wp: kernels.try_linear_bf16(x, wp[0], None, wp[1]),
                 [(w, gemv.pack_weight(w)) for w in bf16], n * k * 2),
    }
    for t in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(t, k).bfloat16()  # [T, in]
        secs = {label: [] for label in fns}
        for fn, weights, _ in fns.values():
            time_pass(fn, x, weights)  # warm-up
        for _ in range(args.reps):
            for label, (fn, weights, _) in fns.items():
                secs[label].append(time_pass(fn, x, weights))
        line = [f"{name:8s} {k:4d}->{n:<6d} T={t:<2d}"]
        for label, (_, _, nbytes) in fns.items():
            ms = [s * 1e3 for s in secs[label]]
            gbs = [nbytes / s / 1e9 for s in secs[label]]
            line.append(f"{label} {stats(ms, '7.3f')} ms {stats(gbs, '5.1f')} GB/s")
        speedup = [b / a for a, b in zip(secs["ours"], secs["torch"])]
        vs_bf16 = [b / a for a, b in zip(secs["ours"], secs["bf16"])]
        line.append(f"torch/ours {stats(speedup, '5.2f')}x  bf16/ours {stats(vs_bf16, '5.2f')}x")
        print(" | ".join(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8",
                    help="rows of x, comma-separated (beyond 32: the bf16-slice path)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-bytes", type=float, default=512 * 2 ** 20,
                    help="bytes of weight copies cycled per implementation and shape")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                    help=f"matrices, comma-separated, of {', '.join(s[0] for s in SHAPES)}")
    args = ap.parse_args()
    torch.manual_seed(0)
    for what, reason in (("int4", gemv_int4.kernel_unavailable_reason()),
                         ("bf16", kernels.kernel_unavailable_reason())):
        if reason is not None:
            raise SystemExit(f"{what} kernel unavailable: {reason}")
    print(f"{torch.get_num_threads()} threads (OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}); >= {args.min_bytes / 2 ** 20:.0f} "
          f"MiB of weights per implementation; min/median over {args.reps} reps (ms: "
          f"per call; GB/s: weight bytes read)", flush=True)
    with torch.inference_mode():
        for name, k, n in SHAPES:
            if name in args.shapes.split(","):
                bench_shape(name, k, n, args)


if __name__ == "__main__":
    main()
