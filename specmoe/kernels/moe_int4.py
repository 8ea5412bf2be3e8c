"""The routed experts of a MoE layer in one native call on CPU, int4 experts and bf16
activations, through `moe_int4.c`.

One call takes x [T, H], the router's top-k ids and weights and every expert's int4 gate/up
and down projections (the layout of `specmoe.kernels.gemv_int4`, all experts stacked, as
`QuantizedRoutedExperts` keeps them) to out [T, H]: the (token, slot) pairs are sorted by
expert inside the kernel, each active expert's int4 weights are streamed once for all of its
rows, threads share the active experts' output rows, and a token's k contributions are
weighted in fp32 and summed in slot order, rounded once. There is no Python loop over
experts and no host synchronisation.

Bits. Every expert projection is the int4 linear kernel's arithmetic on that expert's rows,
whose sums do not depend on the other rows, so a token's output depends only on its own x
row, ids and weights (batch invariance, at any number of tokens and rows per expert), and
equals `QuantizedRoutedExperts.forward_loop`'s wherever that loop runs the int4 kernel for
every expert (at most `gemv_int4.MAX_SPLIT_ROWS` rows per expert, or any number in
`gemv_int4.set_batch_invariant` mode). The C source gives the details.

`Int4Experts` holds one layer's stacked int4 experts, checked once; `try_moe_int4` runs the
kernel, or returns None where it does not apply (kernels off or not built, another device
or dtype, autograd), and the caller runs the per-expert loop.
"""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels import gemv, gemv_int4, moe_common
from specmoe.kernels.build import LazyKernel
from specmoe.kernels.moe_common import scratch_buffer

GROUP_SIZE = gemv_int4.GROUP_SIZE


def load_kernel(extra_flags: tuple[str, ...] = ()):
    """The ctypes function `specmoe_moe_int4` (the C source gives its arguments), built and
    loaded by `moe_common.load_kernel` (which says what it carries and raises)."""
    return moe_common.load_kernel("moe_int4.c", "specmoe_moe_int4", "specmoe_moe_int4",
                                  ctypes.POINTER(gemv_int4._CWeights),
                                  gemv_int4._REQUIRED_CPU_FLAGS, extra_flags)


_lazy = LazyKernel(load_kernel,
                   "CPU fused int4 MoE kernel unavailable, using the per-expert int4 loop")

# None when the kernel is built and loaded (building it now if needed), else why not.
kernel_unavailable_reason = _lazy.unavailable_reason


def scratch_bytes(t: int, k: int, h: int, i: int, n: int) -> int:
    """Bytes of scratch one call over t tokens needs (the kernel must be loaded)."""
    return _lazy.get().scratch_bytes(t, k, h, i, n)


def scratch_for(t: int, k: int, h: int, i: int, n: int) -> torch.Tensor:
    """This thread's scratch (`moe_common.scratch_buffer`, the bf16 kernel's too), large
    enough for one call over t tokens (the kernel must be loaded)."""
    return scratch_buffer(scratch_bytes(t, k, h, i, n))


class Int4Experts:
    """One layer's N SwiGLU experts in the int4 kernel's layout, stacked, checked once.

    Args:
        w13_packed: [N, 2I, H / 2] uint8 (gate rows [0, I), up rows [I, 2I)).
        w13_scales, w13_zeros: [N, 2I, H / 32] bfloat16.
        w2_packed: [N, H, I / 2] uint8; w2_scales, w2_zeros: [N, H, I / 32] bfloat16.
        All contiguous on CPU (as `QuantizedRoutedExperts` keeps them); W = (q - 8) * scale
        + zero per group of 32 inputs (`gemv_int4.pack_int4`).
    Raises:
        ValueError: tensors that do not fit together or the layout (the message names
            which and its shape).
    """

    __slots__ = ("tensors", "num_experts", "hidden_size", "intermediate_size", "w13", "w2")

    def __init__(self, w13_packed: torch.Tensor, w13_scales: torch.Tensor,
                 w13_zeros: torch.Tensor, w2_packed: torch.Tensor, w2_scales: torch.Tensor,
                 w2_zeros: torch.Tensor) -> None:
        if w13_packed.dim() != 3 or w2_packed.dim() != 3:
            raise ValueError(f"w13_packed must be [N, 2I, H / 2] and w2_packed [N, H, I / 2], "
                             f"got {tuple(w13_packed.shape)} and {tuple(w2_packed.shape)}")
        n, two_i, h = w13_packed.shape[0], w13_packed.shape[1], 2 * w13_packed.shape[2]
        i = two_i // 2
        if not n or two_i % 2 or h % GROUP_SIZE or i % GROUP_SIZE or not h or not i:
            raise ValueError(f"w13_packed {tuple(w13_packed.shape)}: H and I must be positive "
                             f"multiples of {GROUP_SIZE}, N positive")
        want = {"w13_packed": ((n, two_i, h // 2), torch.uint8),
                "w13_scales": ((n, two_i, h // GROUP_SIZE), torch.bfloat16),
                "w13_zeros": ((n, two_i, h // GROUP_SIZE), torch.bfloat16),
                "w2_packed": ((n, h, i // 2), torch.uint8),
                "w2_scales": ((n, h, i // GROUP_SIZE), torch.bfloat16),
                "w2_zeros": ((n, h, i // GROUP_SIZE), torch.bfloat16)}
        given = (w13_packed, w13_scales, w13_zeros, w2_packed, w2_scales, w2_zeros)
        for (name, (shape, dtype)), t in zip(want.items(), given):
            if (tuple(t.shape) != shape or t.dtype is not dtype or not t.is_cpu
                    or not t.is_contiguous()):
                raise ValueError(f"{name} must be {list(shape)} contiguous {dtype} on CPU, "
                                 f"got {tuple(t.shape)} {t.dtype} on {t.device}")
        self.tensors = given
        self.num_experts, self.hidden_size, self.intermediate_size = n, h, i
        # all experts' rows as one matrix each: [N 2I, H] and [N H, I]
        self.w13 = gemv_int4._CWeights(w13_packed.data_ptr(), w13_scales.data_ptr(),
                                       w13_zeros.data_ptr(), h // 2, h // GROUP_SIZE, None,
                                       h, n * two_i)
        self.w2 = gemv_int4._CWeights(w2_packed.data_ptr(), w2_scales.data_ptr(),
                                      w2_zeros.data_ptr(), i // 2, i // GROUP_SIZE, None,
                                      i, n * h)

    def __reduce__(self):
        """Copies and pickles rebuild the C views from the copied tensors."""
        return Int4Experts, self.tensors


def applies(x: torch.Tensor) -> bool:
    """Whether `try_moe_int4` would run the kernel on x (kernels on and built, bf16 on CPU,
    no autograd); shapes are checked by `try_moe_int4`, which raises on a mismatch."""
    if not gemv.is_enabled() or not x.is_cpu or x.dtype is not torch.bfloat16:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return (_lazy.kernel or _lazy.get()) is not None


def try_moe_int4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 experts: Int4Experts, num_threads: int | None = None
                 ) -> torch.Tensor | None:
    """out[t] = sum_s topk_weights[t, s] * expert_{topk_ids[t, s]}(x[t]) for int4 SwiGLU
    experts, in one native call, or None where the kernel does not apply (see `applies`;
    then run the per-expert loop).

    Args:
        x: [T, H] bfloat16 CPU.
        topk_ids: [T, k] int64, each in [0, N).
        topk_weights: [T, k] float32 or bfloat16 (other float dtypes are converted to
            float32, exactly for float16).
        experts: the layer's `Int4Experts`.
        num_threads: OpenMP threads to use at most (default torch's intra-op count; small
            work runs on fewer).
    Returns:
        [T, H] bfloat16, or None.
    Raises:
        ValueError: shapes that do not fit together, ids not int64, weights not floating
            point, or an expert id outside [0, N) (found by the kernel before it writes
            anything for those tokens).
    """
    if not applies(x):
        return None
    moe_common.check_routing(x, topk_ids, topk_weights, experts.hidden_size)
    out, _ = run_kernel(_lazy.kernel or _lazy.get(), x, topk_ids, topk_weights, experts,
                        num_threads)
    return out


def run_kernel(kernel, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               experts: Int4Experts, num_threads: int | None = None
               ) -> tuple[torch.Tensor, int]:
    """Call a kernel from `load_kernel` on inputs checked as `try_moe_int4` checks them (no
    checks here but the kernel's own). Returns (out [T, H] bfloat16, the most threads a
    chunk ran on).

    Raises:
        ValueError: an expert id outside [0, N).
    """
    n, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_size
    k = topk_ids.shape[1]
    token_bytes = kernel.scratch_bytes(2, k, h, i, n) - kernel.scratch_bytes(1, k, h, i, n)
    return moe_common.run_chunked(kernel, x, topk_ids, topk_weights, experts.w13, experts.w2,
                                  h, i, n, token_bytes, num_threads)
