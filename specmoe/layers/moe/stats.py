"""Expert statistics recorders. A disabled recorder is a no-op object, not an `if`."""

from __future__ import annotations

import torch


class NullExpertStats:
    """Records nothing (the default)."""

    def record(self, layer_idx: int, topk_ids: torch.Tensor) -> None:
        """topk_ids [num_tokens, top_k] int64 of one MoE layer's forward."""


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

    def record(self, layer_idx: int, topk_ids: torch.Tensor) -> None:
        ids = topk_ids.detach().to("cpu")
        self.routing.setdefault(layer_idx, []).append(ids)
        self.unique_experts.setdefault(layer_idx, []).append(int(ids.unique().numel()))
