"""What the two fused MoE kernels' Python sides share (`specmoe.kernels.moe` for bf16
experts, `specmoe.kernels.moe_int4` for int4 ones): both C entry points take the same
arguments but for the experts' weights (`moe_common.h` holds their shared C), so loading
them, checking the routing they are given, the per-thread scratch and the call in chunks of
tokens are written once here.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from specmoe.kernels.build import load

_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

# Scratch (sorted rows, their gathered or prepared x, gate/up, activations, down outputs)
# is kept per thread, one buffer for both kernels, and grown as needed; a call needing more
# than this many bytes runs in chunks of tokens (the same bits: a token's output does not
# depend on the others).
SCRATCH_BUDGET = 64 << 20

_scratch = threading.local()


def scratch_buffer(num_bytes: int) -> torch.Tensor:
    """This thread's scratch, at least `num_bytes` long (grown, never shrunk)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < num_bytes:
        buf = _scratch.buf = torch.empty(num_bytes, dtype=torch.uint8)
    return buf


def load_kernel(source: str, entry: str, prefix: str, weights_type,
                cpu_flags: tuple[str, ...], extra_flags: tuple[str, ...] = ()):
    """Build and load the fused MoE kernel `source`; returns its ctypes function `entry`,
    taking (x, topk_ids, topk_weights, weights_bf16, w13, w2, out, scratch, T, k, H, I, N,
    num_threads) with w13 and w2 of ctypes type `weights_type`, with its library at
    `.library` and the library's `{prefix}_scratch_bytes(T, k, H, I, N)` at
    `.scratch_bytes` (`{prefix}_isa()` is set up too).

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    lib = load(source, extra_flags, cpu_flags)
    fn = getattr(lib, entry)
    fn.argtypes = [_P, _P, _P, _T, weights_type, weights_type, _P, _P, _I, _I, _I, _I, _I, _T]
    fn.restype = ctypes.c_int
    scratch_bytes = getattr(lib, f"{prefix}_scratch_bytes")
    scratch_bytes.argtypes = [_I] * 5
    scratch_bytes.restype = ctypes.c_int64
    getattr(lib, f"{prefix}_isa").restype = ctypes.c_int
    fn.library, fn.scratch_bytes = lib, scratch_bytes
    return fn


def check_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  hidden_size: int) -> None:
    """Raises ValueError unless x is [T, hidden_size], topk_ids [T, k] int64 on CPU with
    k >= 1 and topk_weights floating point on CPU of the same shape."""
    h = hidden_size
    if x.dim() != 2 or x.shape[1] != h:
        raise ValueError(f"x must be [T, {h}], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [{x.shape[0]}, k] with k >= 1, got "
                         f"{tuple(topk_ids.shape)}")
    if topk_ids.dtype is not torch.int64 or not topk_ids.is_cpu:
        raise ValueError(f"topk_ids must be int64 on CPU, got {topk_ids.dtype} on "
                         f"{topk_ids.device}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_cpu:
        raise ValueError(f"topk_weights must be {tuple(topk_ids.shape)} on CPU like topk_ids, "
                         f"got {tuple(topk_weights.shape)} on {topk_weights.device}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")


def run_chunked(kernel, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w13, w2, hidden_size: int, intermediate_size: int, num_experts: int,
                token_bytes: int, num_threads: int | None = None) -> tuple[torch.Tensor, int]:
    """Call a kernel from `load_kernel` on checked inputs (no checks here but the kernel's
    own), in chunks of tokens whose scratch stays within SCRATCH_BUDGET.

    Args:
        kernel: the loaded entry point.
        x, topk_ids, topk_weights: as `check_routing` checks them; topk_weights other than
            float32 or bfloat16 are converted to float32.
        w13, w2: the experts' weights as the kernel takes them.
        hidden_size, intermediate_size, num_experts: H, I and N.
        token_bytes: the scratch one more token needs (sets the chunk size).
        num_threads: OpenMP threads to use at most (default torch's intra-op count).
    Returns:
        (out [T, H] bfloat16, the most threads a chunk ran on).
    Raises:
        ValueError: an expert id outside [0, N).
    """
    n, h, i = num_experts, hidden_size, intermediate_size
    t, k = x.shape[0], topk_ids.shape[1]
    out = torch.empty(t, h, dtype=torch.bfloat16)
    if t == 0:
        return out, 0
    x, topk_ids = x.contiguous(), topk_ids.contiguous()
    if topk_weights.dtype not in (torch.float32, torch.bfloat16):
        topk_weights = topk_weights.float()
    topk_weights = topk_weights.contiguous()
    weights_bf16 = int(topk_weights.dtype is torch.bfloat16)
    threads = torch.get_num_threads() if num_threads is None else num_threads
    chunk = max(1, min(t, SCRATCH_BUDGET // token_bytes))
    buf = scratch_buffer(kernel.scratch_bytes(chunk, k, h, i, n))
    used = 0
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        rc = kernel(x[t0].data_ptr(), topk_ids[t0].data_ptr(), topk_weights[t0].data_ptr(),
                    weights_bf16, w13, w2, out[t0].data_ptr(), buf.data_ptr(), t1 - t0, k, h,
                    i, n, threads)
        if rc == -2:
            bad = topk_ids[(topk_ids < 0) | (topk_ids >= n)]
            raise ValueError(f"expert ids must be in [0, {n}), got {bad[:8].tolist()}")
        if rc < 0:  # the callers' checks rule it out
            raise RuntimeError(f"{kernel.__name__} rejected T={t1 - t0}, k={k}, H={h}, I={i}, "
                               f"N={n}: {rc}")
        used = max(used, rc)
    return out, used
