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
import threading

import torch

from specmoe.kernels import gemv, gemv_int4
from specmoe.kernels.build import LazyKernel, load

_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_W = ctypes.POINTER(gemv_int4._CWeights)
GROUP_SIZE = gemv_int4.GROUP_SIZE

# Scratch (sorted rows, their prepared x, gate/up, activations, down outputs) is kept per
# thread and grown as needed; a call needing more than this many bytes runs in chunks of
# tokens (the same bits: a token's output does not depend on the others).
SCRATCH_BUDGET = 64 << 20


def load_kernel(extra_flags: tuple[str, ...] = ()):
    """Build and load the kernel; returns the ctypes function `specmoe_moe_int4` (see the C
    source for its arguments) with its library at `.library`.

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    lib = load("moe_int4.c", extra_flags, gemv_int4._REQUIRED_CPU_FLAGS)
    fn = lib.specmoe_moe_int4
    fn.argtypes = [_P, _P, _P, _T, _W, _W, _P, _P, _I, _I, _I, _I, _I, _T]
    fn.restype = ctypes.c_int
    lib.specmoe_moe_int4_scratch_bytes.argtypes = [_I] * 5
    lib.specmoe_moe_int4_scratch_bytes.restype = ctypes.c_int64
    lib.specmoe_moe_int4_isa.restype = ctypes.c_int
    fn.library = lib
    return fn


_lazy = LazyKernel(load_kernel,
                   "CPU fused int4 MoE kernel unavailable, using the per-expert int4 loop")

# None when the kernel is built and loaded (building it now if needed), else why not.
kernel_unavailable_reason = _lazy.unavailable_reason

_scratch = threading.local()


def scratch_buffer(num_bytes: int) -> torch.Tensor:
    """This thread's scratch, at least `num_bytes` long (grown, never shrunk)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < num_bytes:
        buf = _scratch.buf = torch.empty(num_bytes, dtype=torch.uint8)
    return buf


def scratch_bytes(t: int, k: int, h: int, i: int, n: int) -> int:
    """Bytes of scratch one call over t tokens needs (the kernel must be loaded)."""
    return _lazy.get().library.specmoe_moe_int4_scratch_bytes(t, k, h, i, n)


def scratch_for(t: int, k: int, h: int, i: int, n: int) -> torch.Tensor:
    """This thread's scratch, large enough for one call over t tokens (the kernel must be
    loaded)."""
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


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
           experts: Int4Experts) -> None:
    h = experts.hidden_size
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
    _check(x, topk_ids, topk_weights, experts)
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
    lib = kernel.library
    per_token = lib.specmoe_moe_int4_scratch_bytes(2, k, h, i, n) - \
        lib.specmoe_moe_int4_scratch_bytes(1, k, h, i, n)
    chunk = max(1, min(t, SCRATCH_BUDGET // per_token))
    buf = scratch_buffer(lib.specmoe_moe_int4_scratch_bytes(chunk, k, h, i, n))
    used = 0
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        rc = kernel(x[t0].data_ptr(), topk_ids[t0].data_ptr(), topk_weights[t0].data_ptr(),
                    weights_bf16, experts.w13, experts.w2, out[t0].data_ptr(),
                    buf.data_ptr(), t1 - t0, k, h, i, n, threads)
        if rc == -2:
            bad = topk_ids[(topk_ids < 0) | (topk_ids >= n)]
            raise ValueError(f"expert ids must be in [0, {n}), got {bad[:8].tolist()}")
        if rc < 0:  # Int4Experts' and try_moe_int4's checks rule it out
            raise RuntimeError(f"specmoe_moe_int4 rejected T={t1 - t0}, k={k}, H={h}, I={i}, "
                               f"N={n}: {rc}")
        used = max(used, rc)
    return out, used
