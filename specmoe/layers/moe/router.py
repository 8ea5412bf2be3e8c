"""Top-k softmax routing of tokens to experts (Shazeer et al. 2017, arXiv 1701.06538;
Mixtral, Jiang et al. 2024, arXiv 2401.04088, eq. 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specmoe.kernels.router import try_route_softmax_bf16
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


def select_experts(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k experts of each row, heaviest first; among equal weights the lower expert
    id wins (and comes first).

    `torch.topk` leaves ties to the backend (on CPU it picked 9 over 4 at a boundary tie, and
    (22, 21, 20, 23) from all-equal weights); bfloat16 router logits tie exactly at the top-k
    boundary in about 1% of rows, so routing, and with it the output, would depend on the
    device. A stable descending sort fixes the rule, the one vLLM's grouped top-k uses.

    Args:
        probs: [T, N] float routing weights.
        top_k: k, 1 <= k <= N.
    Returns:
        (weights [T, k] probs' dtype, ids [T, k] int64).
    """
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    return weights[:, :top_k].contiguous(), ids[:, :top_k].contiguous()


class TopKRouter(nn.Module):
    """softmax(x @ W_gate^T) in float32, keep the top_k experts (ties: lower id wins, see
    `select_experts`), optionally renormalise their weights to sum to 1 (`norm_topk_prob`;
    Mixtral always does, Qwen-MoE/OLMoE by config).

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
        """x [T, H] -> RoutingResult with [T, top_k] ids and weights. bf16 on CPU routes in
        one native call (`specmoe.kernels.router`, which the fused decoder driver calls too);
        `route_reference` is its plain-torch reference, with the same bits where torch runs
        its AVX-512 kernels."""
        logits = self.gate(x)
        routed = try_route_softmax_bf16(logits, self.top_k, self.norm_topk_prob)
        if routed is not None and x.dtype is torch.bfloat16:
            return RoutingResult(*routed)
        return self.route_reference(logits, x.dtype)

    def forward_reference(self, x: torch.Tensor) -> RoutingResult:
        """Plain-torch reference of `forward`."""
        return self.route_reference(self.gate(x), x.dtype)

    def route_reference(self, logits: torch.Tensor, dtype: torch.dtype) -> RoutingResult:
        """The routing of gate outputs `logits` [T, N] in plain torch, weights in `dtype`."""
        probs = torch.softmax(logits.float(), dim=-1)  # [T, N]
        weights, ids = select_experts(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RoutingResult(ids, weights.to(dtype))
