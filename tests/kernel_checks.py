"""Shared checks of the native kernels.

Skip a native-kernel test only where this machine cannot build the kernel: where the CPU
has AVX-512 and a C compiler is on PATH, every kernel must build, so a failed build there
is a defect and the test fails instead of skipping (`require_kernel`). Also: bit-for-bit
comparison, the fused MoE kernels' scratch and argument checks, gemv_int4's
batch-invariant mode, and running a model's forwards with the fused decoder driver on or
off and comparing them.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest
import torch

from specmoe.kernels.build import cpu_reason

AVX512 = ("avx512f", "avx512bw", "avx512vl")


def machine_builds_kernels() -> bool:
    """The CPU has AVX-512 (F, BW, VL) and `$CC` (default gcc) is on PATH."""
    return cpu_reason(AVX512) is None and shutil.which(os.environ.get("CC", "gcc")) is not None


def require_kernel(what: str, reason: str | None) -> None:
    """Nothing when `reason` is None (the kernel is loaded); else fail where this machine
    builds kernels, skip elsewhere."""
    if reason is None:
        return
    if machine_builds_kernels():
        pytest.fail(f"{what} did not build on a machine with AVX-512 and a compiler: {reason}")
    pytest.skip(f"{what} unavailable: {reason}")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bits (a NaN equals itself, +0 differs from -0)."""
    return (a.dtype is b.dtype and a.shape == b.shape
            and torch.equal(a.view(torch.int16), b.view(torch.int16)))


# ---- the fused MoE kernels (specmoe.kernels.moe, specmoe.kernels.moe_int4) ---------------


def poison_moe_scratch() -> None:
    """NaN bytes in this thread's fused MoE kernel scratch (both kernels share it), so that
    a row or panel some call leaves unwritten shows in its output instead of a previous
    call's values."""
    from specmoe.kernels import moe_common
    buf = getattr(moe_common._scratch, "buf", None)
    if buf is not None:
        with torch.inference_mode():  # an earlier model forward may have made it there
            buf.fill_(0xFF)


def check_batch_invariance(call, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           sizes, gen: torch.Generator) -> None:
    """Each token's output bits from `call(x, ids, weights)` (a fused MoE kernel over the T
    tokens given) are the same alone (T = 1) as among each of `sizes` tokens drawn twice
    from them with `gen` (other neighbours, other positions), the scratch poisoned before
    each call."""
    t = x.shape[0]
    alone = torch.cat([call(x[j:j + 1], ids[j:j + 1], weights[j:j + 1]) for j in range(t)])
    for size in sizes:
        for rep in range(2):
            pick = torch.randperm(t, generator=gen)[:size]
            poison_moe_scratch()
            out = call(x[pick], ids[pick], weights[pick])
            assert same_bits(out, alone[pick]), f"{size} tokens, draw {rep}"


def check_routing_errors(call, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                         num_experts: int, wrong_x: torch.Tensor) -> None:
    """`call(x, ids, weights)` (a fused MoE kernel's try_ function on 3 tokens with k = 2
    and ids in range) raises ValueError, naming what is wrong, for an x of the wrong width
    (`wrong_x`), ids or weights of the wrong shape, ids not int64, and each of a few ids
    outside [0, num_experts)."""
    with pytest.raises(ValueError, match=rf"x must be \[T, {x.shape[1]}\]"):
        call(wrong_x, ids, weights)
    with pytest.raises(ValueError, match="topk_ids must be"):
        call(x, ids[:2], weights[:2])
    with pytest.raises(ValueError, match="topk_weights must be"):
        call(x, ids, weights[:, :1])
    with pytest.raises(ValueError, match="int64"):
        call(x, ids.int(), weights)
    for bad in (num_experts, -1, 1000):
        wrong = ids.clone()
        wrong[1, 1] = bad
        with pytest.raises(ValueError,
                           match=rf"expert ids must be in \[0, {num_experts}\), got \[{bad}\]"):
            call(x, wrong, weights)


@contextlib.contextmanager
def int4_batch_invariant():
    """gemv_int4's batch-invariant mode on inside, restored after."""
    from specmoe.kernels import gemv_int4
    was = gemv_int4.is_batch_invariant()
    gemv_int4.set_batch_invariant(True)
    try:
        yield
    finally:
        gemv_int4.set_batch_invariant(was)


# ---- the fused decoder driver (specmoe.models.fused_layers) ------------------------------


@contextlib.contextmanager
def fused_driver(on: bool):
    """The fused decoder driver on (or off) inside, restored after."""
    from specmoe.models import fused_layers
    was = fused_layers._enabled
    fused_layers.set_enabled(on)
    try:
        yield
    finally:
        fused_layers.set_enabled(was)


def run_schedule(model, arch, fused: bool, schedule, tables, cache=None, logits: bool = False,
                 block_size: int = 16):
    """Every forward of `schedule` (per forward, (start position, new tokens) per sequence,
    sequence i in the blocks tables[i]) on random token ids (seeded), the fused driver on
    or off. Returns (outputs: each forward's hidden states, and its logits after them if
    `logits`; the `PagedKVCache`, `cache` or a new one of 12 bf16 blocks)."""
    from specmoe.layers.paged_attention import AttentionMetadata, SequenceSlice
    from specmoe.worker.kv_cache import PagedKVCache
    cache = cache or PagedKVCache(arch, 12, block_size, torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    outs = []
    with fused_driver(fused), torch.inference_mode():
        for step in schedule:
            seqs = [SequenceSlice(s, n, tables[i]) for i, (s, n) in enumerate(step)]
            meta = AttentionMetadata.build(seqs, block_size, "cpu", arch.sliding_window)
            ids = torch.randint(0, arch.vocab_size, (meta.num_tokens,), generator=g)
            pos = torch.cat([torch.arange(s, s + n) for s, n in step])
            hidden = model(ids, pos, cache.layers, meta)
            outs += [hidden, model.compute_logits(hidden)] if logits else [hidden]
    return outs, cache


def assert_same_runs(a, b, dtype: torch.dtype | None = None) -> None:
    """Two `run_schedule` results hold equal outputs (of one dtype, `dtype` if given) and
    equal KV caches."""
    (outs_a, cache_a), (outs_b, cache_b) = a, b
    for x, y in zip(outs_a, outs_b, strict=True):
        assert x.dtype is y.dtype and (dtype is None or x.dtype is dtype) and torch.equal(x, y)
    for (ka, va), (kb, vb) in zip(cache_a.layers, cache_b.layers, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
