"""bf16 linear on CPU for any number of rows, through `gemv_bf16.c`.

torch's bf16 `F.linear` with a handful of rows reads weights at a fraction of memory
bandwidth; this kernel streams every weight row once for all rows of x (speculative
verification puts K + 1 rows through the same weights), so its cost stays nearly flat up to
~8 rows. It also takes prefill-sized inputs (within ~10-15% of oneDNN's `F.linear` there,
faster up to ~64 rows), so that every row of every forward is summed in one order: a
token's outputs have the same bits whatever shares its forward (batch invariance, which
keeps greedy speculative decoding in bf16 equal to plain decoding). `try_linear_bf16`
returns None for anything it does not handle and the caller runs the plain-torch reference
`F.linear`.
"""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels.build import LazyKernel, load
from specmoe.utils.env import env_flag

DISABLE_ENV = "SPECMOE_DISABLE_CPU_KERNELS"
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw")

_enabled = not env_flag(DISABLE_ENV)


def set_enabled(enabled: bool) -> None:
    """Turn the CPU kernels on or off for this process (off: always `F.linear`). The
    environment variable SPECMOE_DISABLE_CPU_KERNELS=1 sets the initial state to off."""
    global _enabled
    _enabled = bool(enabled)


def is_enabled() -> bool:
    """Whether the CPU kernels are switched on (they may still be unavailable)."""
    return _enabled


def load_kernel(extra_flags: tuple[str, ...] = ()):
    """Build and load the kernel; returns the ctypes function
    `specmoe_linear_bf16(x, w, bias | NULL, y, T, K, N, num_threads) -> int` with its
    library at `.library`.

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    lib = load("gemv_bf16.c", extra_flags, REQUIRED_CPU_FLAGS)
    fn = lib.specmoe_linear_bf16
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.specmoe_gemv_isa.restype = ctypes.c_int
    fn.library = lib
    return fn


_lazy = LazyKernel(load_kernel, "CPU bf16 linear kernel unavailable, using F.linear")


# None when the kernel is built and loaded (building it now if needed), else why not; the
# first failure is logged once as a warning.
kernel_unavailable_reason = _lazy.unavailable_reason


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    bf16 = torch.bfloat16
    if not (x.is_cpu and weight.is_cpu and x.dtype is bf16 and weight.dtype is bf16):
        return False
    shape, w_shape = x.shape, weight.shape
    if (len(w_shape) != 2 or not shape or shape[-1] != w_shape[1] or not w_shape[0]
            or not w_shape[1] or not x.is_contiguous() or not weight.is_contiguous()):
        return False
    if not x.numel():
        return False
    if bias is not None and not (bias.is_cpu and bias.dtype is bf16 and bias.is_contiguous()
                                 and bias.shape == w_shape[:1]):
        return False
    return not torch.is_grad_enabled() or not (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))


def try_linear_bf16(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """y = x @ weight^T (+ bias) with fp32 accumulation, or None where the kernel does not
    apply (then call `F.linear`).

    Args:
        x: [..., in_features] bfloat16, contiguous, CPU, at least one row.
        weight: [out_features, in_features] bfloat16, contiguous, CPU.
        bias: [out_features] bfloat16 or None.
    Returns:
        [..., out_features] bfloat16, or None: kernels off or unavailable, another device
        or dtype, non-contiguous input, no rows, or autograd needed. Raises nothing.
    """
    if not _enabled or not _eligible(x, weight, bias):
        return None
    kernel = _lazy.get()
    return None if kernel is None else run_kernel(kernel, x, weight, bias)


def run_kernel(kernel, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """Call a kernel from `load_kernel` on inputs already checked as `try_linear_bf16`
    requires (no checks here). Returns [..., out_features] bfloat16."""
    num_out, num_in = weight.shape
    y = torch.empty(*x.shape[:-1], num_out, dtype=torch.bfloat16)  # [..., out_features]
    kernel(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
           y.data_ptr(), x.numel() // num_in, num_in, num_out, torch.get_num_threads())
    return y
