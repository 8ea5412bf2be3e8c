"""Weight-only quantised linear layers for bandwidth-bound decoding.

Decoding one token reads every weight once, so bytes per weight set the speed. These layers
keep weights as int8 (symmetric, one scale per output channel) or int4 (asymmetric, one scale
and offset per group of `group_size` inputs, as in GPTQ/AWQ-style group quantisation). int8
multiplies with PyTorch's fused CPU kernel `aten._weight_int8pack_mm`. int4 runs our own
`specmoe.kernels.gemv_int4`: its int4 kernel for 1..32 input rows (decode, verification),
reading the weights at close to memory bandwidth (torch's int4 kernel reaches about half of
it), and bf16 slices of the weights through our bf16 GEMM for more rows (prefill); torch's
`aten._weight_int4pack_mm_for_cpu` runs where ours cannot. Each has a plain-torch reference
that dequantises and calls `F.linear`; other devices use the reference.

The kernels are fast for bfloat16 activations only (float32 ones take a path ~25-50x slower),
so activations are rounded to bfloat16 for the matmul and the result is cast back; the
references round the same way.

Their cost grows with the number of input rows (ours too, though more slowly), unlike the
bf16 kernel whose cost stays almost flat up to ~8 rows, so they suit the draft model (one
token per forward) more than a target that verifies K + 1 tokens at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.config import QUANTIZATION_METHODS
from specmoe.kernels import gemv, gemv_int4

INT4_GROUP_SIZE = 32
_INT4_N_ALIGN = 64  # the CPU int4 kernel works on tiles of output channels
KERNEL_DTYPE = torch.bfloat16


class Int8Linear(nn.Module):
    """y = x @ (q * s[:, None])^T + b with q int8 [out, in] and s [out].

    Built with `from_weight(weight [out, in], bias [out] | None)`; scales are kept in
    bfloat16. Rounding error per weight is at most s / 2 = max|w_row| / 254.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # [out, in] int8
        self.register_buffer("scales", scales)    # [out]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "Int8Linear":
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [out]
        scales = scales.to(KERNEL_DTYPE).float()  # round first, so q is exact for them
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales.to(KERNEL_DTYPE), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""
        if x.device.type != "cpu":
            return self.forward_reference(x)
        y = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE).contiguous(), self.qweight,
                                               self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain torch: dequantise, then F.linear in float32 on bf16-rounded activations."""
        w = self.qweight.float() * self.scales.float()[:, None]
        y = F.linear(x.to(KERNEL_DTYPE).float(), w).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x @ W^T + b with W[n, g*G + j] = q[n, g*G + j] * scale[n, g] + min[n, g],
    q in [0, 15], G = group_size.

    On a CPU that can run our kernels, and with G = 32, the layer keeps the weights in the
    layout of `specmoe.kernels.gemv_int4` (`cpu_kernel`, a `gemv_int4.Int4Weights`, not a
    buffer): its int4 kernel serves 1..32 input rows (decode, verification), and more rows
    (prefill) run on bf16 slices of the weights through our bf16 GEMM, up to twice as fast as
    torch's int4 kernel there. Elsewhere, or with our kernels off, torch's fused kernel runs:
    it takes q packed by `aten._convert_weight_to_int4pack_for_cpu` (a tiled layout) and
    `scales_and_zeros` [in / G, out, 2] holding (scale, min + 8 * scale), since it computes
    (q - 8) * scale + zero. The plain-torch reference is `int4_linear_reference` on the
    unpacked q from `quantize_int4`; off CPU the layer keeps unpacked q and uses it.
    """

    def __init__(self, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.is_cpu = q.device.type == "cpu"
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1) if self.is_cpu else q
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.group_size = group_size
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.cpu_kernel = _int4_kernel_weights(q, scales_and_zeros, group_size, bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                    group_size: int = INT4_GROUP_SIZE) -> "Int4Linear":
        q, sz = quantize_int4(weight, group_size)
        return cls(q, sz, group_size, bias)

    def extra_weights(self) -> list[torch.Tensor]:
        """Our kernel's packed weights, scales and zeros (none without it), for
        `specmoe.utils.hugepages.rehome_module`."""
        k = self.cpu_kernel
        return [] if k is None else [k.packed, k.scales, k.zeros]

    def set_extra_weights(self, tensors: list[torch.Tensor]) -> None:
        """Point our kernel at copies of `extra_weights()` (same values, e.g. in huge pages)."""
        if self.cpu_kernel is not None:
            self.cpu_kernel = gemv_int4.Int4Weights(*tensors, self.cpu_kernel.bias)
            gemv.PackedWeight.generation += 1  # a packed copy moved: see its docstring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""
        if not self.is_cpu:
            return int4_linear_reference(x, self.packed, self.scales_and_zeros,
                                         self.group_size, self.bias)
        if self.cpu_kernel is not None:
            y = self.cpu_kernel.linear(x)  # None: kernels off or x it does not take
            if y is not None:
                return y
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(KERNEL_DTYPE).contiguous(), self.packed, self.group_size,
            self.scales_and_zeros).to(x.dtype)
        return y if self.bias is None else y + self.bias


def _int4_kernel_weights(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                         bias: torch.Tensor | None) -> gemv_int4.Int4Weights | None:
    """Our kernels' copy of the weights (`gemv_int4.Int4Weights`), or None where they cannot
    run (not CPU, another group size, a CPU without AVX-512). The kernel itself is built at
    its first call."""
    if (q.device.type != "cpu" or group_size != gemv_int4.GROUP_SIZE
            or gemv_int4.cpu_unsupported_reason()):
        return None
    return gemv_int4.Int4Weights(*gemv_int4.pack_int4(q, scales_and_zeros), bias)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 quantisation per group of `group_size` inputs.

    Returns:
        q [out, in] int32 in [0, 15], and scales_and_zeros [in / G, out, 2] bfloat16.
    Raises:
        ValueError: when the shape does not fit the CPU kernel's tiling (`can_int4`).
    """
    if not can_int4(weight, group_size):
        raise ValueError(f"int4 needs in_features % {group_size} == 0 and out_features % "
                         f"{_INT4_N_ALIGN} == 0; got weight {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    # Scale and zero are stored in bfloat16: round them first and quantise against the
    # rounded values, so dequantisation reproduces q's grid exactly.
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(KERNEL_DTYPE).float()  # [out, groups, 1]
    zero = (lo + 8 * scale).to(KERNEL_DTYPE).float()
    q = torch.round((w - zero) / scale + 8).clamp(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.cat([scale, zero], dim=-1)               # [out, groups, 2]
    return q, sz.transpose(0, 1).contiguous().to(KERNEL_DTYPE)


def int4_dequantize(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] that (q, scales_and_zeros) represent: (q - 8) * scale + zero."""
    n = q.shape[0]
    scale = scales_and_zeros[..., 0].float().t()[..., None]   # [out, groups, 1]
    zero = scales_and_zeros[..., 1].float().t()[..., None]
    w = (q.float().reshape(n, -1, group_size) - 8) * scale + zero
    return w.reshape(n, -1).to(dtype)


def int4_linear_reference(x: torch.Tensor, q: torch.Tensor, scales_and_zeros: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Plain torch reference of Int4Linear: dequantise, then F.linear in float32 on
    bf16-rounded activations."""
    w = int4_dequantize(q, scales_and_zeros, group_size, torch.float32)
    y = F.linear(x.to(KERNEL_DTYPE).float(), w).to(x.dtype)
    return y if bias is None else y + bias


def speculation_caveat(model: nn.Module) -> str | None:
    """Why greedy speculative decoding on `model` may not give the tokens of plain decoding
    because of its quantised layers (their sums change order with the rows of a forward), or
    None where they cannot: no quantised layer, or only int4 layers on our CPU kernel in
    batch-invariant mode (`gemv_int4.set_batch_invariant`). Judged now: switching kernels or
    the mode later changes the answer.
    """
    layers = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    if any(isinstance(m, Int8Linear) for m in layers):
        return "its int8 layers run torch's int8 kernel, which is not batch-invariant"
    if not layers:
        return None
    if any(not m.is_cpu for m in layers):
        return "off CPU its int4 layers run the plain-torch reference, not batch-invariant"
    reason = gemv_int4.kernel_unavailable_reason() if gemv.is_enabled() else "switched off"
    if reason is not None or any(m.cpu_kernel is None for m in layers):
        return (f"our int4 kernel cannot run ({reason or 'unsupported layer'}), and torch's "
                "int4 kernel is not batch-invariant")
    if gemv_int4.is_batch_invariant():
        return None
    return (f"its kernel sums a token's outputs in one order only up to "
            f"{gemv_int4.MAX_SPLIT_ROWS} rows per forward (e.g. 4 requests with K <= 7; "
            f"{gemv_int4.BATCH_INVARIANT_ENV}=1: any number, slower prefill)")


def can_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> bool:
    n, k = weight.shape
    return k % group_size == 0 and n % _INT4_N_ALIGN == 0


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, method: str) -> nn.Module:
    """An Int8Linear or Int4Linear for weight [out, in]; int4 falls back to int8 for shapes
    the int4 kernel cannot tile.

    Raises:
        ValueError: for a method other than int8 / int4.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}: choose one of "
                         f"{QUANTIZATION_METHODS}")
    if method == "int4" and can_int4(weight):
        return Int4Linear.from_weight(weight, bias)
    return Int8Linear.from_weight(weight, bias)


# Layers left in full precision: routers decide which experts run (a small error flips a
# top-k choice) and cost little to read.
_KEEP_FULL_PRECISION = ("router.gate", "shared_expert_gate")


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace every dense projection of `model` (attention, MLP, shared expert, LM head) by
    its weight-only quantised version; routed experts, routers, embeddings and norms stay.

    Returns:
        the number of layers replaced.
    Raises:
        ValueError: for an unknown method.
    """
    from specmoe.layers.embed_head import TiedProjection
    from specmoe.layers.linear import Linear
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, (Linear, TiedProjection))
               and not name.endswith(_KEEP_FULL_PRECISION)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = getattr(module, "bias", None)
        quantized = quantize_linear(module.weight.data, None if bias is None else bias.data,
                                    method)
        setattr(parent, child, quantized)
    return len(targets)
