"""The CPU vector unit's multiply-add peak (`peak.c`), for compute floors."""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels.build import LazyKernel, load
from specmoe.kernels.gemv import REQUIRED_CPU_FLAGS


def load_kernel():
    """Build and load `specmoe_vector_peak(iters, bf16, num_threads, repeats) -> flop/s`.

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    fn = load("peak.c", cpu_flags=REQUIRED_CPU_FLAGS).specmoe_vector_peak
    fn.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_double
    return fn


_lazy = LazyKernel(load_kernel, "CPU peak probe unavailable, probing with torch.matmul")


def vector_peak_flops(bf16: bool, num_threads: int | None = None,
                      iters: int = 4_000_000, repeats: int = 5) -> float | None:
    """Best-of-`repeats` flop/s of multiply-adds with no memory traffic on `num_threads`
    threads (None: torch's intra-op threads): bf16 `dot_pairs` as the bf16 matmul kernels
    issue them, or fp32 FMAs (at 4e6 iterations a bf16 repeat takes 13 ms at 469 GF/s).
    None when the kernel cannot be built here (no AVX-512, no compiler)."""
    kernel = _lazy.get()
    if kernel is None:
        return None
    rate = kernel(iters, int(bf16), num_threads or torch.get_num_threads(), repeats)
    return rate if rate > 0 else None
