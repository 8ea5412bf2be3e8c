"""The sparse MoE feed-forward block: router, routed experts, optional shared expert."""

from __future__ import annotations

import torch
from torch import nn

from specmoe.config import MoEConfig
from specmoe.layers.linear import Linear
from specmoe.layers.mlp import GatedMLP
from specmoe.layers.moe.experts import RoutedExperts
from specmoe.layers.moe.router import TopKRouter
from specmoe.layers.moe.stats import NullExpertStats


class SparseMoEBlock(nn.Module):
    """y = sum_j w_j * expert_{e_j}(x) [+ sigmoid(x @ g) * shared_expert(x)].

    The shared expert and its sigmoid gate follow Qwen1.5/Qwen2-MoE (Qwen team 2024);
    routing follows `TopKRouter`.

    Args:
        hidden_size: H.
        moe: the MoE shape and routing options.
        layer_idx: this layer's index, passed to the expert-stats recorder.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.router = TopKRouter.from_config(hidden_size, moe)
        self.experts = RoutedExperts(moe.num_experts, hidden_size, moe.moe_intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size)
            if moe.has_shared_expert_gate:
                self.shared_expert_gate = Linear(hidden_size, 1)
        self.stats = NullExpertStats()
        # The expert implementation is chosen once (see `backends.set_moe_backend`).
        self.run_experts = self.experts.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        routing = self.router(x)
        self.stats.record(self.layer_idx, routing.topk_ids, routing.topk_weights)
        out = self.run_experts(x, routing.topk_ids, routing.topk_weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
