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

import torch

from specmoe.kernels import gemv, moe_common, panel_prefetch
from specmoe.kernels.build import LazyKernel
from specmoe.kernels.gemv import PackedWeight, packed_shape
from specmoe.kernels.moe_common import scratch_buffer


def load_kernel(extra_flags: tuple[str, ...] = ()):
    """The ctypes function `specmoe_moe_bf16` (the C source gives its arguments), built and
    loaded by `moe_common.load_kernel` (which says what it carries and raises)."""
    fn = moe_common.load_kernel("moe_bf16.c", "specmoe_moe_bf16", "specmoe_moe",
                                ctypes.c_void_p, gemv.REQUIRED_CPU_FLAGS, extra_flags)
    panel_prefetch.register(fn.library)  # the expert panels take the linear's setting
    return fn


_lazy = LazyKernel(load_kernel, "CPU fused MoE kernel unavailable, using the expert loop")

# None when the kernel is built and loaded (building it now if needed), else why not.
kernel_unavailable_reason = _lazy.unavailable_reason


def scratch_bytes(t: int, k: int, h: int, i: int, n: int) -> int:
    """Bytes of scratch one call over t tokens needs (the kernel must be loaded)."""
    return _lazy.get().scratch_bytes(t, k, h, i, n)


def scratch_for(t: int, k: int, h: int, i: int, n: int) -> torch.Tensor:
    """This thread's scratch, large enough for one call over t tokens (for callers that
    hand the kernel to native code, as the fused decoder driver does; the kernel must be
    loaded)."""
    return scratch_buffer(scratch_bytes(t, k, h, i, n))


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
    moe_common.check_routing(x, topk_ids, topk_weights, h)


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
    h, k = x.shape[1], topk_ids.shape[1]
    token_bytes = k * (2 * (2 * h + 3 * intermediate_size) + 8)  # rows, x, gate/up, act, y
    return moe_common.run_chunked(kernel, x, topk_ids, topk_weights, w13_packed.data_ptr(),
                                  w2_packed.data_ptr(), h, intermediate_size,
                                  w2_packed.shape[0], token_bytes, num_threads)
