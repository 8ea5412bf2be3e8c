"""Time of the CPU paged-attention kernel (`specmoe/kernels/attention_bf16.c`) against the
plain-torch path it replaces (`specmoe.layers.paged_attention` with the kernels off), on
decode, verification and prefill batches of real model shapes.

Each layer gets its own bf16 KV cache, and every sequence's blocks are scattered at random
over it, as a paged cache fills; all layers' caches together take at least `--min-mib`
(default 512). A case's own keys and values (printed as "KV") come from memory where they
exceed the last-level cache (the decode and verification batches of 16 and 64 sequences),
from cache where they fit (the prefills). After one untimed round of both, kernel and
torch alternate within each repetition in one process; the ratio is taken per repetition and
min/median over repetitions are printed, with the kernel's KV read rate and the largest
difference between the two outputs. The memory read bandwidth is probed first, since the
host's memory phase moves these numbers.

    python bench/bench_attention.py [--model smollm2|qwen1.5b] [--reps 5] [--min-mib 512]
                                    [--cases decode16,verify16x5,decode64,decode1x2000,
                                             prefill769,prefill6x176]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from specmoe import kernels
from specmoe.bench.roofline import PROBE_BYTES, measure_read_bandwidth
from specmoe.layers.paged_attention import AttentionMetadata, SequenceSlice, paged_attention

# (num_heads, num_kv_heads, head_dim, num_layers)
MODELS = {"smollm2": (9, 3, 64, 30), "qwen1.5b": (12, 2, 128, 28)}
# name: (context lengths of the sequences before this forward, new rows per sequence)
CASES = {"decode16": ([208] * 16, 1), "verify16x5": ([208] * 16, 5),
         "decode64": ([300] * 64, 1), "decode1x2000": ([2000], 1), "prefill769": ([0], 769),
         "prefill6x176": ([0] * 6, 176)}  # a ~1000-token prefill step of short prompts
BLOCK_SIZE = 16


def make_case(contexts: list[int], rows: int, num_blocks: int, shape: tuple,
              rng: random.Random) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for sequences with `contexts` tokens cached and `rows` new ones each, their
    blocks drawn at random from num_blocks; and random queries [tokens, heads, head_dim]."""
    num_heads, _, head_dim, _ = shape
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    slices, used = [], 0
    for n in contexts:
        need = -(-(n + rows) // BLOCK_SIZE)
        slices.append(SequenceSlice(n, rows, blocks[used:used + need]))
        used += need
    if used > num_blocks:
        raise ValueError(f"the case needs {used} blocks, the caches have {num_blocks}")
    meta = AttentionMetadata.build(slices, BLOCK_SIZE, "cpu")
    q = torch.randn(len(contexts) * rows, num_heads, head_dim).bfloat16()
    return meta, q


def run_layers(q, caches, meta, scale) -> tuple[float, torch.Tensor]:
    t = time.perf_counter()
    out = None
    for cache in caches:
        out = paged_attention(q, cache, meta, scale)
    return time.perf_counter() - t, out


def bench_case(name: str, caches, shape: tuple, args, rng: random.Random) -> None:
    contexts, rows = CASES[name]
    _, num_kv_heads, head_dim, _ = shape
    num_blocks = caches[0][0].shape[0] // BLOCK_SIZE
    meta, q = make_case(contexts, rows, num_blocks, shape, rng)
    scale = head_dim ** -0.5
    times: dict[bool, list[float]] = {True: [], False: []}
    outs = {}
    for rep in range(args.reps + 1):  # round 0 untimed: first touches, allocations
        for on in (True, False):
            kernels.set_enabled(on)
            seconds, outs[on] = run_layers(q, caches, meta, scale)
            if rep:
                times[on].append(seconds)
    kernels.set_enabled(True)
    keys = sum(n + rows for n in contexts)
    kv_bytes = 2 * keys * num_kv_heads * head_dim * 2 * len(caches)
    ratios = [t / k for k, t in zip(times[True], times[False])]
    diff = (outs[True].float() - outs[False].float()).abs().max().item()
    print(f"{name:13s} KV {kv_bytes / 2**20:6.1f} MiB  kernel {min(times[True]) * 1e3:8.2f} ms "
          f"({kv_bytes / min(times[True]) / 1e9:5.1f} GB/s of KV)  torch "
          f"{min(times[False]) * 1e3:8.2f} ms  speedup min {min(ratios):5.2f}x "
          f"median {statistics.median(ratios):5.2f}x  max |diff| {diff:.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--min-mib", type=int, default=512)
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    cases = args.cases.split(",")
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown cases {bad}: choose from {sorted(CASES)}")
    shape = MODELS[args.model]
    _, num_kv_heads, head_dim, num_layers = shape
    slot_bytes = 2 * num_kv_heads * head_dim * 2  # key + value, bf16
    num_blocks = max((args.min_mib << 20) // (num_layers * slot_bytes * BLOCK_SIZE), 2048)
    torch.manual_seed(0)
    caches = [tuple(torch.randn(num_blocks * BLOCK_SIZE, num_kv_heads, head_dim).bfloat16()
                    for _ in range(2)) for _ in range(num_layers)]
    print(f"{args.model}: {shape[0]} heads, {num_kv_heads} KV heads of {head_dim}, "
          f"{num_layers} layers; KV caches {num_layers * num_blocks * BLOCK_SIZE * slot_bytes / 2**20:.0f} MiB; "
          f"times per {num_layers} layers; torch threads {torch.get_num_threads()}; memory "
          f"read bandwidth {measure_read_bandwidth(PROBE_BYTES, repeats=3) / 1e9:.0f} GB/s")
    if kernels.kernel_unavailable_reason() is not None:
        print(f"kernel unavailable: {kernels.kernel_unavailable_reason()}")
        return
    rng = random.Random(0)
    for name in cases:
        bench_case(name, caches, shape, args, rng)


if __name__ == "__main__":
    main()
