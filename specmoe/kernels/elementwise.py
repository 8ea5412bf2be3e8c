"""RMSNorm, RoPE and SiLU-and-mul on CPU in bfloat16 through `elementwise_bf16.c`.

Each replaces 3-20 small torch ops whose dispatch outweighs the arithmetic at decode sizes,
so at one row most of a call's time is the call itself. The torch code
in `specmoe.layers` (norm.py, rotary.py, mlp.py) is the reference they are tested against
and what runs where they return None/False: another device or dtype, shapes they do not take,
autograd, or kernels switched off (SPECMOE_DISABLE_CPU_KERNELS=1).
"""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels import gemv
from specmoe.kernels.build import LazyKernel, load

_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def load_kernels():
    """Build and load the library; returns it with argument types set on its three
    functions (see the C source).

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    lib = load("elementwise_bf16.c", cpu_flags=gemv.REQUIRED_CPU_FLAGS)
    lib.specmoe_rms_norm_bf16.argtypes = [_P, _I, _P, _P, _I, _I, _I, _F, _T]
    lib.specmoe_rotary_bf16.argtypes = [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _T]
    lib.specmoe_silu_and_mul_bf16.argtypes = [_P, _P, _I, _I, _T]
    for fn in (lib.specmoe_rms_norm_bf16, lib.specmoe_rotary_bf16,
               lib.specmoe_silu_and_mul_bf16):
        fn.restype = ctypes.c_int
    return lib


_lazy = LazyKernel(load_kernels, "CPU elementwise kernels unavailable, using torch ops")


def _library(*tensors: torch.Tensor):
    """The loaded library when every tensor is a bf16 CPU tensor outside autograd and
    kernels are on, else None."""
    if not gemv.is_enabled():
        return None
    for t in tensors:
        if not t.is_cpu or t.dtype is not torch.bfloat16 or (
                t.requires_grad and torch.is_grad_enabled()):
            return None
    return _lazy.get()


def _rows(x: torch.Tensor) -> tuple[int, int] | None:
    """(rows, row stride) of x read as [rows, x.shape[-1]] without a copy, or None: a 2-D
    tensor may have strided rows, a larger one must be contiguous."""
    if x.dim() == 0 or x.shape[-1] == 0:
        return None
    if x.dim() == 2 and x.stride(1) == 1:
        return x.shape[0], x.stride(0)
    return (x.numel() // x.shape[-1], x.shape[-1]) if x.is_contiguous() else None


def try_rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor | None:
    """RMSNorm of x's last dimension (`specmoe.layers.norm.RMSNorm` semantics).

    Args:
        x: [..., H] bfloat16 CPU, last dimension contiguous (2-D row strides allowed).
        weight: [H] bfloat16.
        eps: added to the mean square.
    Returns:
        [..., H] bfloat16, contiguous; or None (see the module docstring; also H not a
        multiple of 16). Raises nothing.
    """
    lib = _library(x, weight)
    rows = _rows(x)
    if lib is None or rows is None or weight.shape != x.shape[-1:] or not weight.is_contiguous():
        return None
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    n, stride = rows
    h = x.shape[-1]
    rc = lib.specmoe_rms_norm_bf16(x.data_ptr(), stride, weight.data_ptr(), out.data_ptr(), h,
                                   n, h, eps, torch.get_num_threads())
    return out if rc == 0 else None


def try_rotary_bf16(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate q and k in place by RoPE at `positions` (`specmoe.layers.rotary` semantics).

    Args:
        positions: [T] int64 CPU.
        q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim] bfloat16 CPU, each head
            row contiguous (rows may be strided, e.g. views of a fused qkv projection).
        cos, sin: [max_position, head_dim // 2] float32 contiguous tables.
    Returns:
        True when rotated; False (nothing written) when the kernel does not apply, head_dim
        is not a multiple of 32, or a position is outside the tables. Raises nothing.
    """
    lib = _library(q, k)
    if lib is None or q.dim() != 3 or k.dim() != 3 or positions.dtype is not torch.int64:
        return False
    t, nq, hd = q.shape
    if (k.shape[0] != t or k.shape[2] != hd or positions.shape != (t,)
            or q.stride(2) != 1 or q.stride(1) != hd or k.stride(2) != 1 or k.stride(1) != hd
            or not (positions.is_cpu and positions.is_contiguous() and cos.is_contiguous()
                    and sin.is_contiguous() and cos.dtype is torch.float32
                    and sin.dtype is torch.float32 and cos.shape[1] * 2 == hd)):
        return False
    rc = lib.specmoe_rotary_bf16(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                                 positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, nq,
                                 k.shape[1], hd, cos.shape[0], torch.get_num_threads())
    return rc == 0


def try_silu_and_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension
    (`specmoe.layers.mlp.GatedMLP` semantics).

    Args:
        gate_up: [..., 2I] bfloat16 CPU, contiguous.
    Returns:
        [..., I] bfloat16; or None (see the module docstring; also I not a multiple of 16).
        Raises nothing.
    """
    lib = _library(gate_up)
    if lib is None or not gate_up.is_contiguous() or gate_up.shape[-1] % 2:
        return None
    i = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], i, dtype=torch.bfloat16)
    rc = lib.specmoe_silu_and_mul_bf16(gate_up.data_ptr(), out.data_ptr(),
                                       gate_up.numel() // max(2 * i, 1), i,
                                       torch.get_num_threads())
    return out if rc == 0 else None
