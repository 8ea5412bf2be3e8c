"""A router wrapper that routes tokens to given experts, for measuring MoE cost under a chosen
routing (the study's correlated routing, a recorded trace) on synthetic weights."""

from __future__ import annotations

import torch
from torch import nn

from specmoe.layers.moe.router import RoutingResult


class ReplayRouter(nn.Module):
    """Runs the wrapped router (its gate matmul, softmax and top-k cost real time), then
    returns the ids set in `next_ids` ([num_tokens, top_k] int64) with equal weights 1/k in
    x's dtype, or the wrapped router's own result while `next_ids` is None."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.next_ids: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> RoutingResult:
        own = self.inner(x)
        if self.next_ids is None:
            return own
        ids = self.next_ids
        return RoutingResult(ids, torch.full(ids.shape, 1.0 / ids.shape[1], dtype=x.dtype,
                                             device=x.device))
