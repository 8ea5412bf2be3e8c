"""int4 weight-only linear for decode-sized inputs (1..16 rows) on CPU, through `gemv_int4.c`.

torch's `aten._weight_int4pack_mm_for_cpu` reads int4 weights far below memory bandwidth at
a few rows, so an int4 draft model gains little over bf16. This kernel streams each weight
row once for all rows of x, multiplying the 4-bit integers as bf16 numbers and applying
each group's scale to its dot product (see the C source for the layout and the math).

The weights go into our own layout with `pack_int4` (from what `quantize_int4` returns);
`try_linear_int4` returns None for anything the kernel does not handle and the caller runs
torch's kernel or the plain-torch reference `int4_linear_reference`. The kernels' common
switch (`specmoe.kernels.set_enabled`, SPECMOE_DISABLE_CPU_KERNELS=1) turns it off too.
"""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels import gemv
from specmoe.kernels.build import KernelBuildError, LazyKernel, load

GROUP_SIZE = 32  # inputs per quantisation group: the only size the kernel takes
MAX_ROWS = gemv.MAX_ROWS  # the most input rows the kernel takes (16)
_REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")
_X_DTYPES = (torch.bfloat16, torch.float32)


def load_kernel(extra_flags: tuple[str, ...] = ()):
    """Build and load the kernel; returns the ctypes function
    `specmoe_linear_int4(x, x_is_bf16, packed, scales, zeros, bias | NULL, y, y_is_bf16,
    T, K, N, num_threads) -> int` with its library at `.library`.

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    reason = gemv._cpu_reason() or _cpu_flags_reason()
    if reason is not None:
        raise KernelBuildError(reason)
    lib = load("gemv_int4.c", extra_flags)
    fn = lib.specmoe_linear_int4
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int]
                   + [ctypes.c_int64] * 3 + [ctypes.c_int])
    fn.restype = ctypes.c_int
    lib.specmoe_gemv_int4_isa.restype = ctypes.c_int
    fn.library = lib
    return fn


def _cpu_flags_reason() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return None  # unknown: let the compiler decide
    missing = [f for f in _REQUIRED_CPU_FLAGS if f not in flags]
    return f"CPU lacks {', '.join(missing)}" if missing else None


_lazy = LazyKernel(load_kernel, "CPU int4 linear kernel unavailable, using torch's int4 kernel")


def kernel_unavailable_reason() -> str | None:
    """None when the kernel is built and loaded (building it now if needed), else why not.
    The first failure is logged once as a warning."""
    _lazy.get()
    return _lazy.unavailable


def pack_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout of int4 weights W = (q - 8) * scale + zero (groups of 32 inputs).

    Args:
        q: [out, in] integers in [0, 15] (int32 as `quantize_int4` returns), in % 32 == 0.
        scales_and_zeros: [in / 32, out, 2] bfloat16 (scale, zero), as `quantize_int4`
            returns.
    Returns:
        packed [out, in / 2] uint8 (byte j of row n = q[n, 2j] | q[n, 2j + 1] << 4), and
        scales, zeros [out, in / 32] bfloat16 each: the given values, not rounded again
        (the kernel folds the -8 into the zero term itself, in fp32).
    Raises:
        ValueError: shapes that do not match, in not a multiple of 32, q outside [0, 15].
    """
    num_out, num_in = q.shape
    if (num_in % GROUP_SIZE or scales_and_zeros.shape != (num_in // GROUP_SIZE, num_out, 2)):
        raise ValueError(f"pack_int4 needs q [out, in] with in % {GROUP_SIZE} == 0 and "
                         f"scales_and_zeros [in / {GROUP_SIZE}, out, 2]; got q "
                         f"{tuple(q.shape)}, scales_and_zeros {tuple(scales_and_zeros.shape)}")
    if q.numel() and not (0 <= int(q.min()) and int(q.max()) <= 15):
        raise ValueError("pack_int4 needs q in [0, 15]")
    q8 = q.to(torch.uint8).reshape(num_out, num_in // 2, 2)
    packed = (q8[..., 0] | (q8[..., 1] << 4)).contiguous()             # [out, in / 2]
    sz = scales_and_zeros.to(torch.bfloat16).transpose(0, 1)          # [out, groups, 2]
    return packed, sz[..., 0].contiguous(), sz[..., 1].contiguous()


def _eligible(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if not (x.is_cpu and packed.is_cpu and x.dtype in _X_DTYPES and x.is_contiguous()
            and x.dim() >= 1 and packed.dtype is torch.uint8 and packed.dim() == 2):
        return False
    num_out, num_in = packed.shape[0], packed.shape[1] * 2
    group_shape = (num_out, num_in // GROUP_SIZE)
    if (x.shape[-1] != num_in or not num_out or num_in % GROUP_SIZE or not num_in
            or not 1 <= x.numel() // num_in <= MAX_ROWS or not packed.is_contiguous()):
        return False
    for t in (scales, zeros):
        if not (t.is_cpu and t.dtype is torch.bfloat16 and t.shape == group_shape
                and t.is_contiguous()):
            return False
    if bias is not None and not (bias.is_cpu and bias.dtype is torch.float32
                                 and bias.is_contiguous() and bias.shape == (num_out,)):
        return False
    return not (torch.is_grad_enabled() and x.requires_grad)


def try_linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor | None:
    """y = x @ W^T (+ bias) for W in `pack_int4`'s layout, x rounded to bfloat16 first, fp32
    accumulation; or None where the kernel does not apply.

    Args:
        x: [..., in] bfloat16 or float32, contiguous, CPU, at most 16 rows in all.
        packed, scales, zeros: from `pack_int4` (on CPU, contiguous).
        bias: [out] float32 or None.
    Returns:
        [..., out] in x's dtype (bf16 output rounded once, after the bias), or None: kernels
        off or unavailable, another device or dtype, non-contiguous input, more than 16
        rows, or autograd needed. Raises nothing.
    """
    if not gemv.is_enabled() or not _eligible(x, packed, scales, zeros, bias):
        return None
    kernel = _lazy.get()
    return None if kernel is None else run_kernel(kernel, x, packed, scales, zeros, bias)


def run_kernel(kernel, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Call a kernel from `load_kernel` on inputs already checked as `try_linear_int4`
    requires (no checks here). Returns [..., out] in x's dtype, or None when the kernel
    could not allocate its work space (nothing computed)."""
    num_out, num_in = packed.shape[0], packed.shape[1] * 2
    is_bf16 = x.dtype is torch.bfloat16
    y = torch.empty(*x.shape[:-1], num_out, dtype=x.dtype)  # [..., out]
    status = kernel(x.data_ptr(), is_bf16, packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                None if bias is None else bias.data_ptr(), y.data_ptr(), is_bf16,
                x.numel() // num_in, num_in, num_out, torch.get_num_threads())
    return y if status == 0 else None  # -2: no memory for the kernel's work space
