"""Expert statistics recorders. A disabled recorder is a no-op object, not an `if`.

The protocol (what `set_expert_stats` attaches to every MoE block): one call per MoE layer
and forward, `record(layer_idx, topk_ids, topk_weights)`, with the tensors still on the
model's device; a recorder that needs them on the host copies them itself.
"""

from __future__ import annotations

import torch


class NullExpertStats:
    """Records nothing (the default)."""

    def record(self, layer_idx: int, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> None:
        """topk_ids [num_tokens, top_k] int64 and topk_weights [num_tokens, top_k] (the gate
        weights, in the hidden dtype) of one MoE layer's forward."""


class ExpertStatsRecorder:
    """Keeps, per MoE layer, the top-k expert ids of every forward and the number of unique
    experts each forward touched (the experts whose weights had to be read).

    Attributes:
        routing: layer index -> list of [num_tokens, top_k] int64 CPU tensors, one per forward.
        unique_experts: layer index -> list of unique expert counts, one per forward.
    """

    def __init__(self) -> None:
        self.routing: dict[int, list[torch.Tensor]] = {}
        self.unique_experts: dict[int, list[int]] = {}

    def record(self, layer_idx: int, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> None:
        ids = topk_ids.detach().to("cpu")
        self.routing.setdefault(layer_idx, []).append(ids)
        self.unique_experts.setdefault(layer_idx, []).append(int(ids.unique().numel()))


class ExpertLoadRecorder:
    """Counts, per MoE layer, the tokens routed to each expert (an expert-stats recorder for
    `set_expert_stats`). Counts stay on the model's device during a step; `take` reads them
    at the step boundary (the one host sync).

    Args:
        num_experts: experts per layer (N).
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._counts: dict[int, torch.Tensor] = {}  # layer -> [num_experts] int64

    def record(self, layer_idx: int, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> None:
        """topk_ids [num_tokens, top_k] int64 of one MoE layer's forward (the gate weights
        are not used)."""
        counts = torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
        if layer_idx in self._counts:
            self._counts[layer_idx] += counts
        else:
            self._counts[layer_idx] = counts

    def take(self) -> dict[int, list[int]]:
        """Counts since the previous call, per layer, and reset."""
        out = {layer: c.tolist() for layer, c in self._counts.items()}
        self._counts = {}
        return out
