"""Dense linear layers, including the fused projections used by attention and MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.kernels import try_linear_bf16


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias): x [..., in], weight [out, in], bias [out] -> [..., out].

    bf16 inputs on CPU take the native kernel (`specmoe.kernels.gemv`), which reads the
    weight once for all rows at close to memory bandwidth when decoding and sums every row
    in one order whatever the number of rows; everything else, and the kernel switched off,
    takes the reference `F.linear`. Raises what `F.linear` raises on mismatched shapes.
    """
    y = try_linear_bf16(x, weight, bias)
    return F.linear(x, weight, bias) if y is None else y


class Linear(nn.Module):
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features], x's dtype."""
        return linear(x, self.weight, self.bias)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Plain-torch reference of `forward`."""
        return F.linear(x, self.weight, self.bias)
