"""Routed SwiGLU experts: a grouped implementation that reads each active expert's weights
once per forward, and the plain per-token reference it is tested against."""

from __future__ import annotations

import torch
from torch import nn

from specmoe.kernels import gemv
from specmoe.kernels.gemv import PackedWeight
from specmoe.layers.linear import PackedWeights, linear
from specmoe.layers.mlp import silu_and_mul


class RoutedExperts(PackedWeights, nn.Module):
    """N SwiGLU experts with stacked weights.

    Parameters:
        w13: [N, 2 * I, H] gate (rows [0, I)) and up (rows [I, 2I)) projections.
        w2: [N, H, I] down projections.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # Read by the weight loader: leading expert dimension, gate/up row shards of w13.
        self.w13.num_experts = self.w2.num_experts = num_experts
        self.w13.shard_sizes = [intermediate_size, intermediate_size]
        self.w13_panels, self.w2_panels = PackedWeight(), PackedWeight()

    def packed_weights(self) -> list[tuple[PackedWeight, torch.Tensor]]:
        return [(self.w13_panels, self.w13), (self.w2_panels, self.w2)]

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x [n, H] -> [n, H] (`linear`: the decode kernel for a few rows, on
        the experts' packed weights)."""
        h = linear(x, self.w13[e], packed=self._panels(self.w13_panels, self.w13, e, x))
        h = silu_and_mul(h)
        return linear(h, self.w2[e], packed=self._panels(self.w2_panels, self.w2, e, h))

    @staticmethod
    def _panels(cache: PackedWeight, weights: torch.Tensor, e: int, x: torch.Tensor
                ) -> torch.Tensor | None:
        """Expert e's packed weight where the kernel takes x or the weights were released
        (all experts packed at once)."""
        if weights.is_meta or gemv.applies(x, weights[e]):
            return cache.get(weights)[e]
        return None

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                ) -> torch.Tensor:
        """Grouped forward: sort (token, expert) pairs by expert, one matmul per active expert.

        x [T, H]; topk_ids [T, k] int64; topk_weights [T, k] (x's dtype). Returns [T, H].
        The per-expert counts are read on the host once per call (a fused GPU kernel would
        avoid this sync; the plain-torch path needs it to slice).
        """
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)                       # [T * k]
        order = torch.argsort(flat_ids, stable=True)          # pairs grouped by expert
        token_idx = order // top_k                            # [T * k]
        weights = topk_weights.reshape(-1)[order].unsqueeze(1)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = token_idx[start:start + n]
            y = self.expert_forward(e, x[idx]) * weights[start:start + n]
            out.index_add_(0, idx, y)
            start += n
        return out

    def forward_reference(self, x: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor) -> torch.Tensor:
        """Plain per-token reference of `forward`: for each token, sum its k experts."""
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(topk_ids.shape[1]):
                e = int(topk_ids[t, j])
                out[t] += (self.expert_forward(e, x[t:t + 1]) * topk_weights[t, j])[0]
        return out
