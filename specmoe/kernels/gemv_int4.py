"""int4 weight-only linear on CPU, through `gemv_int4.c`: decode-sized inputs (1..32 rows) by
its int4 kernel, more rows (prefill) by dequantising slices of the weights to bf16 for our bf16
GEMM.

torch's `aten._weight_int4pack_mm_for_cpu` reads int4 weights far below memory bandwidth at
a few rows, so an int4 draft model gained little over bf16. This kernel streams each weight
row once for all rows of x, multiplies the 4-bit integers as bf16 numbers and applies each
group's scale to its dot product (the C source gives the layout and the math). One call
takes up to MAX_ROWS = 16 rows and gives each row the bits it gets alone; 17 to
MAX_SPLIT_ROWS = 32 rows run as two such calls, so speculative verification of several
requests stays batch-invariant (lossless) up to 32 rows per forward, at about the cost of
the alternative below (faster near 17 rows, slower near 32).

With more rows the multiplies set the pace, and torch's int4 kernel runs at about half of our
bf16 GEMM's rate (`specmoe.kernels.gemv`); so there the weights are dequantised to bf16, a
slice of at most `DEQUANT_SLICE_BYTES` at a time (it stays in the last-level cache), and
multiplied by that GEMM, faster than torch's int4 kernel (bench/bench_int4.py times
both). Rounding the weights to bf16 errs by up to 2^-9 |x| . |W| per
output: far below the int4 grid for ordinary groups, but a group whose values sit on a large
common offset (range well under 2^-7 of its magnitude) loses its int4 levels, where torch's
int4 kernel, which does not round the weights, keeps them.

`set_batch_invariant(True)` (or SPECMOE_INT4_BATCH_INVARIANT=1 in the environment) runs every
number of rows as int4 kernel calls of at most MAX_ROWS rows instead: each row then has the
bits it gets alone in any forward, so greedy speculation on an int4 target gives the tokens
of plain decoding at any batch size and with chunked prefills, and no weight is rounded to
bf16; prefill runs slower than on the bf16 slices (still faster than torch's int4
kernel). Prefills then compute
without the weights' bf16 rounding, so greedy outputs can differ from the default mode's.

`pack_int4` puts what `quantize_int4` returns into the kernel's layout; `Int4Weights` holds
one layer's packed weights, checked once, and its `linear` runs the kernel on x or returns
None where the kernel does not apply (the caller then runs torch's kernel or the plain-torch
reference `specmoe.layers.quantization.int4_linear_reference`). `try_linear_int4` does both
in one call. The kernels' common switch (`specmoe.kernels.set_enabled`,
SPECMOE_DISABLE_CPU_KERNELS=1) turns this one off too.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading

import torch

from specmoe.kernels import gemv
from specmoe.kernels.build import LazyKernel, cpu_reason, load
from specmoe.utils.env import env_flag

GROUP_SIZE = 32  # inputs per quantisation group: the only size the kernel takes
MAX_ROWS = 16  # the most input rows of one int4 kernel call
MAX_SPLIT_ROWS = 32  # up to this many rows: int4 kernel calls of <= MAX_ROWS rows each
DEQUANT_SLICE_BYTES = 8 << 20  # bf16 weights dequantised at a time beyond MAX_SPLIT_ROWS
BATCH_INVARIANT_ENV = "SPECMOE_INT4_BATCH_INVARIANT"
_batch_invariant = env_flag(BATCH_INVARIANT_ENV)
_REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")
_X_DTYPES = (torch.bfloat16, torch.float32)


class _CWeights(ctypes.Structure):
    """`struct specmoe_int4_weights` of the C source."""
    _fields_ = [("packed", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("zeros", ctypes.c_void_p), ("w_stride", ctypes.c_int64),
                ("sz_stride", ctypes.c_int64), ("bias", ctypes.c_void_p),
                ("num_in", ctypes.c_int64), ("num_out", ctypes.c_int64)]


@functools.cache
def cpu_unsupported_reason() -> str | None:
    """Why this machine cannot run the kernel (not x86-64 Linux, no AVX-512 F/BW/VL), or None;
    reads /proc/cpuinfo once, builds nothing."""
    return cpu_reason(_REQUIRED_CPU_FLAGS)


def load_kernel(extra_flags: tuple[str, ...] = ()):
    """Build and load the kernel; returns the ctypes function
    `specmoe_linear_int4(weights*, x, y, T, is_bf16, num_threads) -> int` with its library at
    `.library`.

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    lib = load("gemv_int4.c", extra_flags, _REQUIRED_CPU_FLAGS)
    fn = lib.specmoe_linear_int4
    fn.argtypes = [ctypes.POINTER(_CWeights), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.specmoe_gemv_int4_isa.restype = ctypes.c_int
    lib.specmoe_int4_to_bf16_panels.argtypes = [ctypes.POINTER(_CWeights), ctypes.c_void_p,
                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.specmoe_int4_to_bf16_panels.restype = ctypes.c_int
    fn.library = lib
    return fn


_lazy = LazyKernel(load_kernel, "CPU int4 linear kernel unavailable, using torch's int4 kernel")


def set_batch_invariant(enabled: bool) -> None:
    """Run every number of rows as int4 kernel calls of at most MAX_ROWS rows (True), or more
    than MAX_SPLIT_ROWS rows on bf16 slices of the weights (False, the default; the
    environment variable SPECMOE_INT4_BATCH_INVARIANT=1 sets the initial state to True).
    Process-wide and read by every call: set it before generating, not while another thread
    runs a forward (its layers would mix the two modes)."""
    global _batch_invariant
    _batch_invariant = bool(enabled)


def is_batch_invariant() -> bool:
    """Whether the batch-invariant mode is on (see `set_batch_invariant`)."""
    return _batch_invariant


def batch_invariant_in_effect() -> bool:
    """The mode is on and our int4 kernel runs (kernels on, the kernel built): what a report
    should record, building the kernel if needed."""
    return _batch_invariant and gemv._enabled and kernel_unavailable_reason() is None


# None when the kernel is built and loaded (building it now if needed), else why not; the
# first failure is logged once as a warning.
kernel_unavailable_reason = _lazy.unavailable_reason


def pack_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout of int4 weights W = (q - 8) * scale + zero, groups of 32 inputs.

    Args:
        q: [out, in] integers in [0, 15] (int32 as `quantize_int4` returns), in % 32 == 0.
        scales_and_zeros: [in / 32, out, 2] (scale, zero), as `quantize_int4` returns
            (bfloat16; other float dtypes are rounded to it).
    Returns:
        packed [out, in / 2] uint8 (byte j of row n = q[n, 2j] | q[n, 2j + 1] << 4), and
        scales, zeros [out, in / 32] bfloat16 each: the given values, not rounded again (the
        kernel folds the -8 into the zero term itself, in fp32).
    Raises:
        ValueError: shapes that do not match, in not a multiple of 32, q outside [0, 15].
    """
    num_out, num_in = q.shape
    if num_in % GROUP_SIZE or scales_and_zeros.shape != (num_in // GROUP_SIZE, num_out, 2):
        raise ValueError(f"pack_int4 needs q [out, in] with in % {GROUP_SIZE} == 0 and "
                         f"scales_and_zeros [in / {GROUP_SIZE}, out, 2]; got q "
                         f"{tuple(q.shape)}, scales_and_zeros {tuple(scales_and_zeros.shape)}")
    if q.numel() and not (int(q.min()) >= 0 and int(q.max()) <= 15):
        raise ValueError("pack_int4 needs q in [0, 15]")
    q8 = q.to(torch.uint8).reshape(num_out, num_in // 2, 2)
    packed = (q8[..., 0] | (q8[..., 1] << 4)).contiguous()       # [out, in / 2]
    sz = scales_and_zeros.to(torch.bfloat16).transpose(0, 1)    # [out, groups, 2]
    return packed, sz[..., 0].contiguous(), sz[..., 1].contiguous()


class Int4Weights:
    """One layer's int4 weights in `pack_int4`'s layout (plus an optional bias), checked once,
    so that `linear` only checks x.

    Args:
        packed: [out, in / 2] uint8; scales, zeros: [out, in / 32] bfloat16 (all contiguous,
            on CPU, as `pack_int4` returns).
        bias: [out] or None (kept as a float32 copy).
    Raises:
        ValueError: tensors that do not fit together or the layout (the message says which).
    """

    __slots__ = ("packed", "scales", "zeros", "bias", "num_in", "num_out", "_c")

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        if packed.dtype is not torch.uint8 or packed.dim() != 2:
            raise ValueError(f"packed must be [out, in / 2] uint8, got {packed.dtype} "
                             f"{tuple(packed.shape)}")
        num_out, num_in = packed.shape[0], packed.shape[1] * 2
        group_shape = (num_out, num_in // GROUP_SIZE)
        if not num_out or not num_in or num_in % GROUP_SIZE:
            raise ValueError(f"in_features must be a positive multiple of {GROUP_SIZE}, "
                             f"got {num_in} (out_features {num_out})")
        for name, t in (("scales", scales), ("zeros", zeros)):
            if t.dtype is not torch.bfloat16 or t.shape != group_shape:
                raise ValueError(f"{name} must be {list(group_shape)} bfloat16, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if bias is not None and bias.shape != (num_out,):
            raise ValueError(f"bias must be [{num_out}], got {tuple(bias.shape)}")
        for t in (packed, scales, zeros):
            if not (t.is_cpu and t.is_contiguous()):
                raise ValueError("packed, scales and zeros must be contiguous CPU tensors")
        self.packed, self.scales, self.zeros = packed, scales, zeros
        self.bias = None if bias is None else bias.detach().to("cpu", torch.float32).contiguous()
        self.num_in, self.num_out = num_in, num_out
        self._c = _CWeights(packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), num_in // 2,
                            num_in // GROUP_SIZE,
                            None if self.bias is None else self.bias.data_ptr(), num_in, num_out)

    def __reduce__(self):
        """Copies and pickles rebuild the C view of the weights from the copied tensors."""
        return Int4Weights, (self.packed, self.scales, self.zeros, self.bias)

    def linear(self, x: torch.Tensor) -> torch.Tensor | None:
        """y = x @ W^T (+ bias), x rounded to bfloat16 first, fp32 accumulation; or None
        where the kernel does not apply.

        Up to MAX_SPLIT_ROWS rows (any number with `set_batch_invariant(True)`, or where
        the bf16 GEMM is unavailable) run the int4 kernel, in calls of at most MAX_ROWS
        rows, each row with the bits it gets alone; more run `dequantized_linear` (weights
        rounded to bf16, then our bf16 GEMM).

        Args:
            x: [..., in] bfloat16 or float32, contiguous, CPU.
        Returns:
            [..., out] in x's dtype (bf16 output rounded once, after the bias; on bf16
            slices always rounded to bf16), or None: kernels off or unavailable,
            another device or dtype, non-contiguous x, no rows, or autograd needed. Raises
            nothing.
        """
        if not gemv._enabled or x.dtype not in _X_DTYPES or not x.is_cpu:
            return None
        num_rows = x.numel() // self.num_in
        if (not x.shape or x.shape[-1] != self.num_in or num_rows < 1
                or not x.is_contiguous() or (x.requires_grad and torch.is_grad_enabled())):
            return None
        kernel = _lazy.kernel or _lazy.get()
        if kernel is None:
            return None
        if num_rows > MAX_SPLIT_ROWS and not _batch_invariant:
            y = dequantized_linear(kernel, self, x)
            if y is not None:
                return y  # else (no bf16 GEMM) int4 kernel calls, as in batch-invariant mode
        if num_rows > MAX_ROWS:
            y = _split_rows(kernel, self, x.view(num_rows, self.num_in))
            return None if y is None else y.view(*x.shape[:-1], self.num_out)
        return run_kernel(kernel, self, x)

    def to_bf16_panels(self, kernel, start: int, end: int, out: torch.Tensor) -> None:
        """Rows [start, end) of W as bf16, computed as `int4_dequantize(..., torch.bfloat16)`
        does, bit for bit, into out in the bf16 kernel's packed layout of those rows
        (`gemv.packed_shape(end - start, in)`, contiguous; what `gemv.pack_weight` gives).

        Raises:
            ValueError: a row range outside [0, out_features] or an `out` that does not fit
                (not that shape, contiguous bfloat16 on CPU).
        """
        if not 0 <= start <= end <= self.num_out:
            raise ValueError(f"rows [{start}, {end}) outside [0, {self.num_out}]")
        shape = gemv.packed_shape(end - start, self.num_in)
        if (out.dtype is not torch.bfloat16 or not out.is_cpu or not out.is_contiguous()
                or tuple(out.shape) != shape):
            raise ValueError(f"out must be {list(shape)} contiguous bfloat16 "
                             f"on CPU, got {out.dtype} {tuple(out.shape)} on {out.device}")
        status = kernel.library.specmoe_int4_to_bf16_panels(self._c, out.data_ptr(), start,
                                                            end, torch.get_num_threads())
        if status != 0:  # the checks above rule it out
            raise RuntimeError(f"int4 dequantisation rejected rows [{start}, {end}): {status}")


def run_kernel(kernel, weights: Int4Weights, x: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Call a kernel from `load_kernel` on x already checked as `Int4Weights.linear` requires
    (no checks here), at most MAX_ROWS rows; into `out` (contiguous, [..., out] in x's dtype)
    if given. Returns [..., out] in x's dtype, or None when the kernel could not allocate its
    work space (nothing computed)."""
    y = torch.empty(*x.shape[:-1], weights.num_out, dtype=x.dtype) if out is None else out
    status = kernel(weights._c, x.data_ptr(), y.data_ptr(), x.numel() // weights.num_in,
                    x.dtype is torch.bfloat16, torch.get_num_threads())
    return y if status == 0 else None


def _split_rows(kernel, weights: Int4Weights, x: torch.Tensor) -> torch.Tensor | None:
    """x [T, in] with MAX_ROWS < T: kernel calls on balanced runs of at most MAX_ROWS rows
    (e.g. 17 -> 8 + 9, 40 -> 13 + 13 + 14), each into its rows of y [T, out]; None if a
    call fails."""
    num_rows = x.shape[0]
    num_calls = -(-num_rows // MAX_ROWS)
    y = torch.empty(num_rows, weights.num_out, dtype=x.dtype)
    start = 0
    for i in range(num_calls):
        end = start + (num_rows - start) // (num_calls - i)
        if run_kernel(kernel, weights, x[start:end], y[start:end]) is None:
            return None
        start = end
    return y


_slice = threading.local()  # per thread: its bf16 weight slice buffer


def _slice_buffer(num_elements: int) -> torch.Tensor:
    """A bf16 buffer of at least `num_elements`, reused by later calls on this thread."""
    buf = getattr(_slice, "buffer", None)
    if buf is None or buf.numel() < num_elements:
        buf = _slice.buffer = torch.empty(num_elements, dtype=torch.bfloat16)
    return buf[:num_elements]


def dequantized_linear(kernel, weights: Int4Weights, x: torch.Tensor) -> torch.Tensor | None:
    """y = x @ W^T (+ bias) for x already checked as `Int4Weights.linear` requires, by
    slices of output rows: each slice of W dequantised to bf16 straight into the bf16
    kernel's packed layout (`Int4Weights.to_bf16_panels`, at most
    DEQUANT_SLICE_BYTES) and multiplied by the bf16 GEMM with x rounded to bf16 and the bias
    rounded to bf16 (added before the output's one rounding).

    Returns:
        [..., out] in x's dtype (its values bf16), or None where the bf16 GEMM is off or
        unavailable. Raises nothing.
    """
    if gemv.kernel_unavailable_reason() is not None:
        return None
    k, n = weights.num_in, weights.num_out
    xb = x.reshape(-1, k).to(torch.bfloat16)  # [T, in]
    bias = None if weights.bias is None else weights.bias.to(torch.bfloat16)
    rows = min(n, max(gemv.PANEL, DEQUANT_SLICE_BYTES // (2 * k) // gemv.PANEL * gemv.PANEL))
    y = torch.empty(xb.shape[0], n, dtype=torch.bfloat16) if n > rows else None  # [T, out]
    buf = _slice_buffer(math.prod(gemv.packed_shape(rows, k)))
    for start in range(0, n, rows):
        end = min(n, start + rows)
        shape = gemv.packed_shape(end - start, k)
        packed = buf[:math.prod(shape)].view(shape)
        weights.to_bf16_panels(kernel, start, end, packed)
        shape_only = torch.empty(end - start, k, dtype=torch.bfloat16, device="meta")
        part = gemv.try_linear_bf16(xb, shape_only, None if bias is None else bias[start:end],
                                    packed)
        if part is None:
            return None
        if y is None:
            y = part
        else:
            y[:, start:end] = part
    return y.view(*x.shape[:-1], n).to(x.dtype)


def try_linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor | None:
    """`Int4Weights(packed, scales, zeros, bias).linear(x)`, or None also where the weights do
    not fit the layout (checks the weights on every call: layers keep an `Int4Weights`).

    Args:
        x: [..., in] bfloat16 or float32, contiguous, CPU.
        packed, scales, zeros: from `pack_int4`.
        bias: [out] or None.
    Returns:
        [..., out] in x's dtype, or None. Raises nothing.
    """
    try:
        weights = Int4Weights(packed, scales, zeros, bias)
    except ValueError:
        return None
    return weights.linear(x)
