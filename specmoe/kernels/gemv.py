"""bf16 linear on CPU for any number of rows, through `gemv_bf16.c`, on weights packed in
its panel layout.

torch's bf16 `F.linear` with a handful of rows reads weights at a fraction of memory
bandwidth; this kernel streams every weight panel once for all rows of x (speculative
verification puts K + 1 rows through the same weights), so its cost stays nearly flat up to
~8 rows. It also takes prefill-sized inputs (about oneDNN's `F.linear` rate there), so that
every row of every forward is summed in one order: a token's outputs have the same bits
whatever shares its forward (batch invariance, which keeps greedy speculative decoding in
bf16 equal to plain decoding).

The kernel reads W [out, in] in panels of 64 output rows, pair-interleaved along the input
(`pack_weight`; the C source gives the layout and the summation order). Layers keep their
packed copy in a `PackedWeight`, made on first use (the model loader makes it at load, moves
it into huge pages and drops the dense weight); `try_linear_bf16` packs a weight it is given
without one on every call.
`try_linear_bf16` returns None for anything it does not handle and the caller runs the
plain-torch reference `F.linear`.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from specmoe.kernels import panel_prefetch
from specmoe.kernels.build import LazyKernel, load
from specmoe.utils.env import env_flag

DISABLE_ENV = "SPECMOE_DISABLE_CPU_KERNELS"
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw")
PANEL = 64  # output rows per panel of the packed layout

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
    `specmoe_linear_bf16(x, packed_w, bias | NULL, y, T, K, N, num_threads) -> int` with its
    library at `.library` (which also has `specmoe_pack_bf16(w, out, N, K, num_threads)`).

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    lib = load("gemv_bf16.c", extra_flags, REQUIRED_CPU_FLAGS)
    fn = lib.specmoe_linear_bf16
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.specmoe_pack_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [
        ctypes.c_int]
    lib.specmoe_pack_bf16.restype = ctypes.c_int
    lib.specmoe_gemv_isa.restype = ctypes.c_int
    panel_prefetch.register(lib)
    fn.library = lib
    return fn


_lazy = LazyKernel(load_kernel, "CPU bf16 linear kernel unavailable, using F.linear")


# None when the kernel is built and loaded (building it now if needed), else why not; the
# first failure is logged once as a warning.
kernel_unavailable_reason = _lazy.unavailable_reason


def packed_shape(num_out: int, num_in: int) -> tuple[int, int, int, int]:
    """Shape of W [num_out, num_in] packed: [ceil(num_out / 64), ceil(num_in / 2), 64, 2]."""
    return (-(-num_out // PANEL), -(-num_in // 2), PANEL, 2)


def pack_weight_reference(weight: torch.Tensor) -> torch.Tensor:
    """W [..., out, in] in the kernel's panel layout [..., ceil(out / 64), ceil(in / 2), 64,
    2], in plain torch: panel p, pair j, row r holds (W[64p + r, 2j], W[64p + r, 2j + 1]),
    zeros past `out` and past an odd `in`. Same dtype and device as W."""
    *lead, n, k = weight.shape
    num_panels, pairs, _, _ = packed_shape(n, k)
    padded = weight.new_zeros(*lead, num_panels * PANEL, pairs * 2)
    padded[..., :n, :k] = weight
    panels = padded.view(*lead, num_panels, PANEL, pairs, 2)
    return panels.transpose(-3, -2).contiguous()


def unpack_weight(packed: torch.Tensor, num_out: int, num_in: int) -> torch.Tensor:
    """The inverse of `pack_weight_reference`: [..., out, in] from the panel layout."""
    *lead, num_panels, pairs, panel, two = packed.shape
    rows = packed.transpose(-3, -2).reshape(*lead, num_panels * panel, pairs * two)
    return rows[..., :num_out, :num_in].contiguous()


def pack_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """W [..., out, in] in the kernel's panel layout (`pack_weight_reference`'s values), by
    the C packer for contiguous bf16 CPU weights when the kernel is available, else in
    plain torch; into `out` (contiguous, the packed shape and dtype) if given.

    Raises:
        ValueError: `out` of the wrong shape or dtype, or W with fewer than 2 dimensions or
            an empty one.
    """
    if weight.dim() < 2 or not weight.numel():
        raise ValueError(f"weight must be [..., out, in] and non-empty, "
                         f"got {tuple(weight.shape)}")
    *lead, n, k = weight.shape
    shape = (*lead, *packed_shape(n, k))
    if out is not None and (tuple(out.shape) != shape or out.dtype != weight.dtype
                            or not out.is_contiguous() or out.device != weight.device):
        raise ValueError(f"out must be {shape} contiguous {weight.dtype} on {weight.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    kernel = _lazy.get() if _c_packs(weight) else None
    if kernel is None:
        packed = pack_weight_reference(weight)
        return packed if out is None else out.copy_(packed)
    out = torch.empty(shape, dtype=weight.dtype) if out is None else out
    w3, o3 = weight.reshape(-1, n, k), out.view(-1, *shape[-4:])
    for w, o in zip(w3, o3):
        status = kernel.library.specmoe_pack_bf16(w.data_ptr(), o.data_ptr(), n, k,
                                                  torch.get_num_threads())
        if status != 0:  # the shape checks above rule it out
            raise RuntimeError(f"specmoe_pack_bf16 rejected a [{n}, {k}] weight: {status}")
    return out


def _c_packs(weight: torch.Tensor) -> bool:
    return (_enabled and weight.is_cpu and weight.dtype is torch.bfloat16
            and weight.is_contiguous())


class PackedWeight:
    """A layer's packed copy of one weight for the kernel (`pack_weight`), made on first
    use and made again when the weight has changed since (another tensor, other storage,
    shape, or an in-place edit through the tensor itself; an edit through `.data` is not
    seen: call `clear()` after one).

    `PackedWeight.generation` counts the changes of any instance's packed copy (packing,
    `adopt`, `clear`): `specmoe.models.fused_layers` rebuilds its pointer table when it
    moves."""

    generation = 0

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self._key: tuple | None = None
        # the packed tensor itself, weakly: a new tensor may reuse a freed one's address and
        # version count (compared with `is`: weakref == compares the tensors' values)
        self._source: weakref.ref | None = None

    @staticmethod
    def _key_of(weight: torch.Tensor) -> tuple:
        return weight.data_ptr(), weight._version, tuple(weight.shape)

    def _current(self, weight: torch.Tensor) -> bool:
        return (self._source is not None and self._source() is weight
                and self._key == self._key_of(weight))

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of `weight` [..., out, in] bf16, packing it now if needed (a
        weight released to the meta device keeps the copy it had).

        Raises:
            RuntimeError: a released weight without a packed copy.
        """
        if weight.is_meta:
            if self.packed is None:
                raise RuntimeError(f"weight {tuple(weight.shape)} was released without a "
                                   f"packed copy")
            return self.packed
        if not self._current(weight):
            self.packed = pack_weight(weight.detach())
            PackedWeight.generation += 1
            self._key, self._source = self._key_of(weight), weakref.ref(weight)
        return self.packed

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether the packed copy is current for `weight` (on CPU, not released), so that
        the weight's dense values may be dropped (`unpack_weight` gives them back)."""
        return self.packed is not None and not weight.is_meta and self._current(weight)

    def adopt(self, packed: torch.Tensor, weight: torch.Tensor) -> None:
        """Use `packed` (the same values as the current copy, e.g. moved into huge pages)
        as `weight`'s packed copy."""
        self.packed, self._key, self._source = packed, self._key_of(weight), weakref.ref(weight)
        PackedWeight.generation += 1

    def clear(self) -> None:
        self.packed, self._key, self._source = None, None, None
        PackedWeight.generation += 1


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `try_linear_bf16(x, weight, bias)` would run the kernel (kernels on and
    built, CPU bf16, contiguous, shapes that fit, no autograd)."""
    return _enabled and _eligible(x, weight, bias) and _lazy.get() is not None


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    bf16 = torch.bfloat16
    if not (x.is_cpu and (weight.is_cpu or weight.is_meta) and x.dtype is bf16
            and weight.dtype is bf16):
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


def try_linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    packed: torch.Tensor | PackedWeight | None = None) -> torch.Tensor | None:
    """y = x @ weight^T (+ bias) with fp32 accumulation, or None where the kernel does not
    apply (then call `F.linear`).

    Args:
        x: [..., in_features] bfloat16, contiguous, CPU, at least one row.
        weight: [out_features, in_features] bfloat16, contiguous, CPU (or on the meta
            device, released by `specmoe.layers.linear.PackedWeights.release_dense`, with
            `packed` given).
        bias: [out_features] bfloat16 or None.
        packed: weight in the panel layout (a tensor from `pack_weight`, or a
            `PackedWeight` asked for it only when the kernel applies); None packs it for
            this call only (a copy of the weight: fine for tests, slow for decoding).
    Returns:
        [..., out_features] bfloat16, or None: kernels off or unavailable, another device
        or dtype, non-contiguous input, no rows, or autograd needed.
    Raises:
        ValueError: a packed tensor whose shape or dtype does not fit weight.
    """
    if not _enabled or not _eligible(x, weight, bias):
        return None
    kernel = _lazy.get()
    if kernel is None:
        return None
    if isinstance(packed, PackedWeight):
        packed = packed.get(weight)
    elif packed is None:
        if weight.is_meta:  # released, and no packed copy given
            return None
        packed = pack_weight(weight)
    else:
        _check_packed(packed, weight)
    return run_kernel(kernel, x, packed, weight.shape[0], bias)


def _check_packed(packed: torch.Tensor, weight: torch.Tensor) -> None:
    shape = packed_shape(*weight.shape)
    if (tuple(packed.shape) != shape or packed.dtype is not torch.bfloat16
            or not packed.is_cpu or not packed.is_contiguous()):
        raise ValueError(f"packed weight must be {shape} contiguous bfloat16 on CPU for a "
                         f"{tuple(weight.shape)} weight, got {tuple(packed.shape)} "
                         f"{packed.dtype} on {packed.device}")


def run_kernel(kernel, x: torch.Tensor, packed: torch.Tensor, num_out: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """Call a kernel from `load_kernel` on inputs already checked as `try_linear_bf16`
    requires, with the weight packed (no checks here). Returns [..., num_out] bfloat16."""
    num_in = x.shape[-1]
    y = torch.empty(*x.shape[:-1], num_out, dtype=torch.bfloat16)  # [..., out_features]
    kernel(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
           y.data_ptr(), x.numel() // num_in, num_in, num_out, torch.get_num_threads())
    return y
