"""Top-k softmax routing of tokens to experts (Shazeer et al. 2017, arXiv 1701.06538;
Mixtral, Jiang et al. 2024, arXiv 2401.04088, eq. 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specmoe.layers.linear import Linear


@dataclass(slots=True)
class RoutingResult:
    """Which experts each token uses and with what weight.

    Attributes:
        topk_ids: [num_tokens, top_k] int64 expert ids, most weighted first.
        topk_weights: [num_tokens, top_k] in the hidden dtype.
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


class TopKRouter(nn.Module):
    """softmax(x @ W_gate^T) in float32, keep the top_k experts, optionally renormalise their
    weights to sum to 1 (`norm_topk_prob`; Mixtral always does, Qwen-MoE/OLMoE by config).

    Args:
        hidden_size: H.
        num_experts: N.
        top_k: k.
        norm_topk_prob: renormalise the kept weights.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = Linear(hidden_size, num_experts)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> RoutingResult:
        """x [T, H] -> RoutingResult with [T, top_k] ids and weights."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, N]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RoutingResult(ids, weights.to(x.dtype))
