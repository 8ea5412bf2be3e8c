"""Dense linear layers, including the fused projections used by attention and MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.kernels import gemv
from specmoe.kernels.gemv import PackedWeight, try_linear_bf16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | PackedWeight | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias): x [..., in], weight [out, in], bias [out] -> [..., out].

    bf16 inputs on CPU take the native kernel (`specmoe.kernels.gemv`), which reads the
    weight once for all rows at close to memory bandwidth when decoding and sums every row
    in one order whatever the number of rows, from the packed copy `packed` (see
    `gemv.try_linear_bf16`; without one it packs the weight for this call); everything
    else, and the kernel switched off, takes the reference `F.linear`. Raises what
    `F.linear` raises on mismatched shapes.
    """
    y = try_linear_bf16(x, weight, bias, packed)
    return F.linear(x, dense_weight(weight, packed), bias) if y is None else y


def dense_weight(weight: torch.Tensor, packed: torch.Tensor | PackedWeight | None
                 ) -> torch.Tensor:
    """`weight`, or its values unpacked from `packed` where it was released to the meta
    device (`PackedWeights.release_dense`). Raises RuntimeError if it was and there is no
    packed copy."""
    if not weight.is_meta:
        return weight
    if isinstance(packed, PackedWeight):
        packed = packed.get(weight)  # raises without a copy
    elif packed is None:
        raise RuntimeError(f"weight {tuple(weight.shape)} was released and no packed copy "
                           f"was given")
    return gemv.unpack_weight(packed, *weight.shape).to(weight.dtype)


class PackedWeights:
    """For modules whose weights the bf16 kernel reads packed: `packed_weights()` lists
    (cache, weight) pairs. `prepack()` packs them now and `release_dense()` drops the dense
    copies (the model loader calls both before moving the weights into huge pages);
    `extra_weights()` / `set_extra_weights()` let `specmoe.utils.hugepages.rehome_module`
    move the packed copies too."""

    def packed_weights(self) -> list[tuple[PackedWeight, torch.Tensor]]:
        raise NotImplementedError

    def prepack(self) -> None:
        """Pack every weight the kernel will read (bf16 on CPU, kernels on and built)."""
        for cache, weight in self.packed_weights():
            if (weight.is_cpu and weight.dtype is torch.bfloat16 and gemv.is_enabled()
                    and gemv.kernel_unavailable_reason() is None):
                cache.get(weight)

    def release_dense(self) -> int:
        """Drop the dense copy of every weight that is a parameter of this module and has a
        current packed copy (`PackedWeight.holds`): the parameter is replaced by one of the
        same shape and dtype on the meta device, the kernel reads the packed copy and the
        plain-torch paths unpack it per call (`dense_weight`), so a CPU model is not held
        in memory twice. `state_dict()` then has no values for it, and loading or copying
        values into it does nothing (torch warns): load the model again instead. Returns
        bytes freed."""
        freed = 0
        for cache, weight in self.packed_weights():
            name = next((n for n, p in self._parameters.items() if p is weight), None)
            if name is not None and cache.holds(weight):
                setattr(self, name, nn.Parameter(
                    torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                    requires_grad=False))
                freed += weight.nbytes
        return freed

    def extra_weights(self) -> list[torch.Tensor]:
        return [c.packed for c, _ in self.packed_weights() if c.packed is not None]

    def set_extra_weights(self, tensors: list[torch.Tensor]) -> None:
        copies = iter(tensors)
        for cache, weight in self.packed_weights():
            if cache.packed is not None:
                cache.adopt(next(copies), weight)


class Linear(PackedWeights, nn.Module):
    """y = x @ W^T (+ b).

    The weight is [out_features, in_features]. A fused layer (QKV, gate+up) is given a list
    of output sizes; its weight (and bias) then carry `shard_sizes`, so the weight loader can
    place each checkpoint tensor at its row offset.
    """

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool = False):
        super().__init__()
        sizes = out_features if isinstance(out_features, list) else [out_features]
        self.weight = nn.Parameter(torch.empty(sum(sizes), in_features))
        self.bias = nn.Parameter(torch.zeros(sum(sizes))) if bias else None
        if len(sizes) > 1:  # read by the weight loader to place checkpoint shards
            self.weight.shard_sizes = sizes
            if self.bias is not None:
                self.bias.shard_sizes = sizes
        self.weight_panels = PackedWeight()

    def packed_weights(self) -> list[tuple[PackedWeight, torch.Tensor]]:
        return [(self.weight_panels, self.weight)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features], x's dtype."""
        return linear(x, self.weight, self.bias, self.weight_panels)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain-torch reference of `forward`."""
        return F.linear(x, dense_weight(self.weight, self.weight_panels), self.bias)


def prepack_weights(model: nn.Module, release_dense: bool = False) -> int:
    """`prepack()` every `PackedWeights` submodule of `model` and, with `release_dense`,
    drop the dense copies of the packed weights it owns (`release_dense()`) right after.
    Returns the bytes of packed copies."""
    for sub in model.modules():
        if isinstance(sub, PackedWeights):
            sub.prepack()
            if release_dense:  # one module at a time: memory peaks at the model + one module
                sub.release_dense()
    return sum(t.nbytes for t in packed_copies(model))


def packed_copies(model: nn.Module) -> list[torch.Tensor]:
    """The packed copies the `PackedWeights` submodules of `model` hold, in module order."""
    return [t for sub in model.modules() if isinstance(sub, PackedWeights)
            for t in sub.extra_weights()]
