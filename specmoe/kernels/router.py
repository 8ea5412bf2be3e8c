"""MoE gate scoring on CPU for bf16 models, through `router_bf16.c`: TopKRouter's softmax
top-k routing (with `norm_topk_prob` and the lower-id tie rule) and the shared-expert gate's
sigmoid, each in one native call.

`specmoe.layers.moe.router.TopKRouter` routes through `try_route_softmax_bf16` where it
applies, and the fused decoder driver (`specmoe.kernels.decoder`) calls the same C function,
so the two paths route with the same bits by construction. The kernel reproduces the order
of operations of torch's own CPU kernels built for AVX-512 (softmax with SLEEF's exp, the
sum reductions, the division), so it also equals the plain-torch reference
(`TopKRouter.forward_reference`) bit for bit where torch runs its AVX-512 kernels
(tests/layers/test_router_kernel.py checks both), and within a few fp32 ulps of the
probabilities elsewhere.
"""

from __future__ import annotations

import ctypes

import torch

from specmoe.kernels import gemv
from specmoe.kernels.build import LazyKernel, load

_P, _I = ctypes.c_void_p, ctypes.c_int64

MAX_EXPERTS = 1024  # MAX_EXPERTS in the C source
MAX_TOP_K = 64  # MAX_TOP_K in the C source


def load_kernels():
    """Build and load the library; returns it (functions `specmoe_route_softmax_bf16` and
    `specmoe_sigmoid_bf16`).

    Raises:
        KernelBuildError: no suitable CPU, no compiler, or the build failed.
        OSError: the built library cannot be loaded.
    """
    lib = load("router_bf16.c", cpu_flags=gemv.REQUIRED_CPU_FLAGS)
    lib.specmoe_route_softmax_bf16.argtypes = [_P, _I, _I, _I, ctypes.c_int, _P, _P]
    lib.specmoe_route_softmax_bf16.restype = ctypes.c_int
    lib.specmoe_sigmoid_bf16.argtypes = [_P, _P, _I]
    lib.specmoe_sigmoid_bf16.restype = None
    return lib


_lazy = LazyKernel(load_kernels, "CPU router kernel unavailable, routing in torch")

# None when the kernel is built and loaded (building it now if needed), else why not.
kernel_unavailable_reason = _lazy.unavailable_reason


def applies_to(num_experts: int, top_k: int) -> bool:
    """Whether the kernel takes a router of these sizes (and is on and built)."""
    return (gemv.is_enabled() and 1 <= top_k <= min(num_experts, MAX_TOP_K)
            and num_experts <= MAX_EXPERTS and _lazy.get() is not None)


def library():
    """The loaded library, or None (unavailable)."""
    return _lazy.get()


def try_route_softmax_bf16(logits: torch.Tensor, top_k: int, norm_topk_prob: bool
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """softmax(logits.float()) top-k routing in one native call, or None where the kernel
    does not apply (kernels off or not built, not a bf16 CPU [T, N] tensor, N above
    MAX_EXPERTS, k above MAX_TOP_K, autograd).

    Args:
        logits: [T, N] bfloat16 CPU gate outputs.
        top_k: k.
        norm_topk_prob: renormalise the k kept weights to sum to one.
    Returns:
        (ids [T, k] int64, heaviest first, ties to the lower id; weights [T, k] bfloat16).
    """
    if not (logits.is_cpu and logits.dtype is torch.bfloat16 and logits.dim() == 2
            and not (logits.requires_grad and torch.is_grad_enabled())):
        return None
    t, n = logits.shape
    if not applies_to(n, top_k):
        return None
    logits = logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int64)
    weights = torch.empty(t, top_k, dtype=torch.bfloat16)
    rc = _lazy.get().specmoe_route_softmax_bf16(logits.data_ptr(), t, n, top_k,
                                                int(norm_topk_prob), ids.data_ptr(),
                                                weights.data_ptr())
    if rc:  # ruled out above
        raise RuntimeError(f"specmoe_route_softmax_bf16 rejected T={t}, N={n}, k={top_k}")
    return ids, weights


def sigmoid_bf16(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid of a contiguous bf16 CPU tensor through the kernel (for tests; the
    modules call torch.sigmoid, which the driver's use of this kernel reproduces).
    Raises RuntimeError when the kernel is unavailable."""
    lib = _lazy.get()
    if lib is None:
        raise RuntimeError(f"router kernel unavailable: {_lazy.unavailable}")
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.specmoe_sigmoid_bf16(x.data_ptr(), out.data_ptr(), x.numel())
    return out
