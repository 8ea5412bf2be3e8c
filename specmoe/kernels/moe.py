"""The routed experts of a MoE layer in one native call on CPU, bf16, through `moe_bf16.c`.

One call takes x [T, H], the router's top-k ids and weights and every expert's packed
gate/up and down projections (the panel layout of `specmoe.kernels.gemv`, all experts
stacked) to out [T, H]: the (token, slot) pairs are sorted by expert inside the kernel, each
active expert's panels are streamed once for all of its rows, threads share the active
experts' panels, and a token's k contributions are weighted in fp32 and summed in slot
order. There is no Python loop over experts and no host synchronisation. Every output has
the bits of the composition it replaces (per active expert: the bf16 linear kernel on its
rows, the native SiLU-and-mul, the linear kernel again; then the fp32 slot-order sum), and so
does not depend on which other tokens share the call (batch invariance; the C source gives
the details).

`try_moe_bf16` returns None where the kernel does not apply (kernels off or not built,
another device or dtype, I not a multiple of 16, autograd) and the caller runs its
reference (`specmoe.layers.moe.experts.RoutedExperts.forward`).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from specmoe.kernels import gemv
from specmoe.kernels.build import LazyKernel, load
from specmoe.kernels.gemv import PackedWeight, packed_shape

_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

# Scratch (sorted rows, their gathered x, gate/up, activations, down outputs) is kept per
# thread and grown as needed; a call needing more than this many bytes runs in chunks of
# tokens (the same bits: a token's output does not depend on the others).
SCRATCH_BUDGET = 64 << 20


def load_kernel(extra_flags: tuple[str, ...] = ()):
    """Build and load the kernel; returns the ctypes function `specmoe_moe_bf16` (see the C
    source for its arguments) with its library at `.library`.

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    lib = load("moe_bf16.c", extra_flags, gemv.REQUIRED_CPU_FLAGS)
    fn = lib.specmoe_moe_bf16
    fn.argtypes = [_P, _P, _P, _T, _P, _P, _P, _P, _I, _I, _I, _I, _I, _T]
    fn.restype = ctypes.c_int
    lib.specmoe_moe_scratch_bytes.argtypes = [_I] * 5
    lib.specmoe_moe_scratch_bytes.restype = ctypes.c_int64
    lib.specmoe_moe_isa.restype = ctypes.c_int
    fn.library = lib
    return fn


_lazy = LazyKernel(load_kernel, "CPU fused MoE kernel unavailable, using the expert loop")

# None when the kernel is built and loaded (building it now if needed), else why not.
kernel_unavailable_reason = _lazy.unavailable_reason

_scratch = threading.local()


def _scratch_buffer(num_bytes: int) -> torch.Tensor:
    """This thread's scratch, at least `num_bytes` long (grown, never shrunk)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < num_bytes:
        buf = _scratch.buf = torch.empty(num_bytes, dtype=torch.uint8)
    return buf


def scratch_bytes(t: int, k: int, h: int, i: int, n: int) -> int:
    """Bytes of scratch one call over t tokens needs (the kernel must be loaded)."""
    return _lazy.get().library.specmoe_moe_scratch_bytes(t, k, h, i, n)


def scratch_for(t: int, k: int, h: int, i: int, n: int) -> torch.Tensor:
    """This thread's scratch, large enough for one call over t tokens (for callers that
    hand the kernel to native code, as the fused decoder driver does; the kernel must be
    loaded)."""
    return _scratch_buffer(scratch_bytes(t, k, h, i, n))


def applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `try_moe_bf16` would run the kernel on x with these expert weights (kernels
    on and built, bf16 on CPU, intermediate size a multiple of 16, no autograd). Shapes are
    not checked here: `try_moe_bf16` raises on a mismatch."""
    if not gemv.is_enabled():
        return False
    bf16 = torch.bfloat16
    if not (x.is_cpu and x.dtype is bf16 and w13.dtype is bf16 and w2.dtype is bf16
            and (w13.is_cpu or w13.is_meta) and (w2.is_cpu or w2.is_meta)):
        return False
    if w2.dim() != 3 or w2.shape[-1] % 16 or not w2.shape[-1]:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or w13.requires_grad or w2.requires_grad):
        return False
    return _lazy.get() is not None


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
           w13: torch.Tensor, w2: torch.Tensor) -> None:
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w13 must be [N, 2I, H] and w2 [N, H, I], got {tuple(w13.shape)} "
                         f"and {tuple(w2.shape)}")
    n, two_i, h = w13.shape
    if tuple(w2.shape) != (n, h, two_i // 2) or two_i % 2:
        raise ValueError(f"w2 {tuple(w2.shape)} does not fit w13 {tuple(w13.shape)}: "
                         f"expected [{n}, {h}, {two_i // 2}]")
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


def _packed(packed: torch.Tensor | PackedWeight, weight: torch.Tensor, what: str
            ) -> torch.Tensor:
    if isinstance(packed, PackedWeight):
        packed = packed.get(weight)
    n, rows, cols = weight.shape
    shape = (n, *packed_shape(rows, cols))
    if (tuple(packed.shape) != shape or packed.dtype is not torch.bfloat16
            or not packed.is_cpu or not packed.is_contiguous()):
        raise ValueError(f"packed {what} must be {shape} contiguous bfloat16 on CPU for a "
                         f"{tuple(weight.shape)} weight, got {tuple(packed.shape)} "
                         f"{packed.dtype} on {packed.device}")
    return packed


def try_moe_bf16(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w13: torch.Tensor, w2: torch.Tensor,
                 w13_packed: torch.Tensor | PackedWeight,
                 w2_packed: torch.Tensor | PackedWeight,
                 num_threads: int | None = None) -> torch.Tensor | None:
    """out[t] = sum_s topk_weights[t, s] * expert_{topk_ids[t, s]}(x[t]) for SwiGLU experts,
    in one native call, or None where the kernel does not apply (see `applies`; then run
    the reference).

    Args:
        x: [T, H] bfloat16 CPU.
        topk_ids: [T, k] int64, each in [0, N).
        topk_weights: [T, k] float32 or bfloat16 (other float dtypes are converted).
        w13: [N, 2I, H] gate (rows [0, I)) and up (rows [I, 2I)) projections, bfloat16 (may
            be on the meta device, released, with its packed copy given).
        w2: [N, H, I] down projections, bfloat16 (likewise).
        w13_packed, w2_packed: the packed copies (`gemv.pack_weight` of w13 and w2, or the
            `PackedWeight` caches holding them, asked only when the kernel applies).
        num_threads: OpenMP threads to use at most (default torch's intra-op count; small
            work runs on fewer).
    Returns:
        [T, H] bfloat16, or None.
    Raises:
        ValueError: shapes that do not fit together, ids not int64, weights not floating
            point, a packed copy of the wrong shape, or an expert id outside [0, N)
            (found by the kernel before it reads or writes anything for those tokens).
    """
    if not applies(x, w13, w2):
        return None
    _check(x, topk_ids, topk_weights, w13, w2)
    w13p = _packed(w13_packed, w13, "w13")
    w2p = _packed(w2_packed, w2, "w2")
    out, _ = run_kernel(_lazy.get(), x, topk_ids, topk_weights, w13p, w2p,
                        w2.shape[2], num_threads)
    return out


def run_kernel(kernel, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               w13_packed: torch.Tensor, w2_packed: torch.Tensor, intermediate_size: int,
               num_threads: int | None = None) -> tuple[torch.Tensor, int]:
    """Call a kernel from `load_kernel` on inputs checked as `try_moe_bf16` checks them (no
    checks here but the kernel's own). Returns (out [T, H] bfloat16, the most threads a
    chunk ran on).

    Raises:
        ValueError: an expert id outside [0, N).
    """
    n, i = w2_packed.shape[0], intermediate_size
    (t, h), k = x.shape, topk_ids.shape[1]
    out = torch.empty(t, h, dtype=torch.bfloat16)
    if t == 0:
        return out, 0
    x, topk_ids = x.contiguous(), topk_ids.contiguous()
    if topk_weights.dtype not in (torch.float32, torch.bfloat16):
        topk_weights = topk_weights.float()
    topk_weights = topk_weights.contiguous()
    weights_bf16 = int(topk_weights.dtype is torch.bfloat16)
    threads = torch.get_num_threads() if num_threads is None else num_threads
    per_token = k * (2 * (2 * h + 3 * i) + 8)  # bytes of scratch: rows, x, gate/up, act, y
    chunk = max(1, min(t, SCRATCH_BUDGET // per_token))
    buf = _scratch_buffer(kernel.library.specmoe_moe_scratch_bytes(chunk, k, h, i, n))
    used = 0
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        rc = kernel(x[t0].data_ptr(), topk_ids[t0].data_ptr(), topk_weights[t0].data_ptr(),
                    weights_bf16, w13_packed.data_ptr(), w2_packed.data_ptr(),
                    out[t0].data_ptr(), buf.data_ptr(), t1 - t0, k, h, i, n, threads)
        if rc == -2:
            bad = topk_ids[(topk_ids < 0) | (topk_ids >= n)]
            raise ValueError(f"expert ids must be in [0, {n}), got {bad[:8].tolist()}")
        if rc < 0:  # try_moe_bf16's checks rule it out
            raise RuntimeError(f"specmoe_moe_bf16 rejected T={t1 - t0}, k={k}, H={h}, I={i}, "
                               f"N={n}: {rc}")
        used = max(used, rc)
    return out, used
