"""Paged attention on CPU in bfloat16 through `attention_bf16.c`, and in float32 through
`attention_f32.c` (AVX2: every row's sums in one fixed order, so float32 speculation is
lossless on CPUs without AVX-512 too; over a float32 or an int8 KV cache).

Decode, verification and prefill rows alike: the kernel reads each key/value row of a
sequence once per block of query vectors, from the cache, through the block tables, with an
online softmax (FlashAttention's chunked form) and bf16 softmax weights in the P V product.
The plain-torch path (`specmoe.layers.paged_attention`: padded float32 matmuls for
few-query sequences, fused SDPA per prefill) is its fallback and reference; the kernel runs
several times faster than either.
`try_attention_bf16` returns False for anything it does not take, and the caller runs the
torch path.
"""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels import gemv
from specmoe.kernels.build import LazyKernel, load

MAX_ROWS = 65536  # query rows of one sequence the kernel takes (MAX_ROWS in the C source)


def load_kernel():
    """Build and load the kernel; returns the ctypes function
    `specmoe_attention_bf16(...) -> int` (see the C source for its arguments).

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    fn = load("attention_bf16.c", cpu_flags=gemv.REQUIRED_CPU_FLAGS).specmoe_attention_bf16
    fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_lazy = LazyKernel(load_kernel, "CPU attention kernel unavailable, using the torch path")


def available() -> bool:
    """Whether the kernel is built and loaded (building it now if needed)."""
    return _lazy.get() is not None


# None when the kernel is built and loaded (building it now if needed), else why not.
kernel_unavailable_reason = _lazy.unavailable_reason


def try_attention_bf16(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                       seqs, scale: float, sliding_window: int | None,
                       out: torch.Tensor) -> bool:
    """Causal attention of every sequence's query rows, written into `out`.

    Args:
        q: [num_tokens, num_heads, head_dim] bfloat16 CPU queries (RoPE applied).
        kv_cache: (key, value) [num_slots, num_kv_heads, head_dim] bfloat16 caches holding the
            new tokens.
        seqs: a `KernelSequences` (row_start, num_rows, start_pos [S] int64, block_tables
            [S, max_blocks] int64, all contiguous on CPU).
        scale: softmax scale.
        sliding_window: attention window in tokens, or None.
        out: [num_tokens, num_heads * head_dim] bfloat16, contiguous; the sequences' rows are
            written, others untouched.
    Returns:
        True when the kernel ran; False (nothing written) when kernels are off or
        unavailable, or a dtype, device or shape it does not take (head_dim not a multiple
        of 16 or above 256). Raises nothing.
    """
    return _run(_lazy, torch.bfloat16, torch.bfloat16, q, kv_cache, seqs, scale,
                sliding_window, out, ())


def _run(lazy: LazyKernel, dtype: torch.dtype, cache_dtype: torch.dtype, q: torch.Tensor,
         kv_cache: tuple[torch.Tensor, torch.Tensor], seqs, scale: float,
         sliding_window: int | None, out: torch.Tensor, extra: tuple) -> bool:
    """The checks and call the kernels share (`try_attention_bf16` gives the arguments; q
    and out in `dtype`, the caches in `cache_dtype`; `extra` goes before the thread
    count)."""
    k_cache, v_cache = kv_cache
    if not gemv.is_enabled() or torch.is_grad_enabled() and q.requires_grad:
        return False
    if not (q.is_cpu and k_cache.is_cpu and q.dtype is dtype and k_cache.dtype is cache_dtype
            and v_cache.dtype is cache_dtype and out.dtype is dtype and out.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    kernel = lazy.get()
    if kernel is None:
        return False
    q = q.contiguous()
    _, num_heads, head_dim = q.shape
    t = seqs.block_tables
    rc = kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                seqs.row_start.data_ptr(), seqs.num_rows.data_ptr(),
                seqs.start_pos.data_ptr(), t.data_ptr(), t.shape[0], t.shape[1],
                seqs.block_size, num_heads, k_cache.shape[1], head_dim,
                sliding_window or 0, scale, *extra, torch.get_num_threads())
    return rc == 0


def load_kernel_f32():
    """Build and load `attention_f32.c`; returns `specmoe_attention_f32(...) -> int` (the
    arguments of the bf16 kernel, float32 tensors).

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    fn = _load_f32().specmoe_attention_f32
    fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 7 + [ctypes.c_float,
                                                                  ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def load_kernel_int8():
    """`specmoe_attention_f32_i8(...) -> int` of `attention_f32.c`: the float32 kernel's
    arguments over int8 caches, with the key and value scale pointers after the softmax
    scale.

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    fn = _load_f32().specmoe_attention_f32_i8
    fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 7 + [
        ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _load_f32():
    return load("attention_f32.c", cpu_flags=("avx2", "fma"))


_lazy_f32 = LazyKernel(load_kernel_f32, "float32 CPU attention kernel unavailable, using "
                                        "the torch path")


def try_attention_f32(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      seqs, scale: float, sliding_window: int | None, out: torch.Tensor,
                      max_rows: int) -> bool:
    """`try_attention_bf16` for float32 queries, caches and output (head_dim a multiple of
    8), for the sequences of at most `max_rows` query rows only (decode, verification,
    short chunks; the others' rows are left for the caller): each (row, head) attends its
    own keys with sums in one order (see the C source). Returns False (nothing written)
    where it does not apply. Raises nothing."""
    if q.shape[2] % 8:
        return False
    return _run(_lazy_f32, torch.float32, torch.float32, q, kv_cache, seqs, scale,
                sliding_window, out, (max_rows,))


_lazy_int8 = LazyKernel(load_kernel_int8, "int8 KV cache attention kernel unavailable, "
                                          "using the torch path")


def try_attention_int8(q: torch.Tensor, kv_cache, seqs, scale: float,
                       sliding_window: int | None, out: torch.Tensor, max_rows: int) -> bool:
    """`try_attention_f32` (float32 q and out) over an int8 cache: `kv_cache` has int8
    `key`, `value` [num_slots, num_kv_heads, head_dim] and float32 `key_scale`,
    `value_scale` [num_slots, num_kv_heads] (`specmoe.layers.int8_kv.Int8KV`). Returns
    False (nothing written) where it does not apply. Raises nothing."""
    scales = (kv_cache.key_scale, kv_cache.value_scale)
    if q.shape[2] % 8 or not all(t.is_cpu and t.is_contiguous() and t.dtype is torch.float32
                                 for t in scales):
        return False
    return _run(_lazy_int8, torch.float32, torch.int8, q, (kv_cache.key, kv_cache.value), seqs,
                scale, sliding_window, out, (*(t.data_ptr() for t in scales), max_rows))
