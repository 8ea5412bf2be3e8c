"""Expert statistics: each MoE block reports its routing to its model's `ExpertStatsHub`
(`backends.expert_stats`), and recorders subscribe to the hub. A block with no subscriber
holds a `NullExpertStats` (a no-op object, not an `if`), which the fused decoder driver
requires (it hands no routing back).

The recorder protocol: one call per MoE layer and forward, `record(layer_idx, topk_ids,
topk_weights)`, with the tensors still on the model's device; a recorder that needs them on
the host copies them itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class NullExpertStats:
    """Records nothing (the default)."""

    def record(self, layer_idx: int, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> None:
        """topk_ids [num_tokens, top_k] int64 and topk_weights [num_tokens, top_k] (the gate
        weights, in the hidden dtype) of one MoE layer's forward."""


class ExpertStatsHub:
    """One model's routing reports, fanned out to its subscribed recorders (the engine's
    metrics, routing capture, the adaptive policy's overlap sampler, expert-parallel load,
    placement and verification-cost measurements alike). Subscribers join and leave at step
    boundaries; the hub sits in its MoE blocks' `stats` slot only while one is subscribed.

    Args:
        blocks: the model's MoE blocks (`backends.moe_blocks`).
    """

    def __init__(self, blocks: list) -> None:
        self.blocks = blocks
        self._quiet = [block.stats for block in blocks]  # put back, the same objects
        self._subscribers: tuple = ()

    def record(self, layer_idx: int, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> None:
        for recorder in self._subscribers:
            recorder.record(layer_idx, topk_ids, topk_weights)

    @property
    def subscribers(self) -> tuple:
        return self._subscribers

    def subscribe(self, recorder) -> None:
        """Send every later MoE forward's routing to `recorder` too (no-op if subscribed)."""
        if any(r is recorder for r in self._subscribers):
            return
        self._subscribers += (recorder,)
        self._attach()

    def unsubscribe(self, recorder) -> None:
        """Stop sending routing to `recorder` (no-op if it is not subscribed)."""
        if not any(r is recorder for r in self._subscribers):
            return
        self._subscribers = tuple(r for r in self._subscribers if r is not recorder)
        self._attach()

    @contextlib.contextmanager
    def subscribed(self, recorder) -> Iterator:
        """`recorder` subscribed for the block's duration (unsubscribed on error too)."""
        self.subscribe(recorder)
        try:
            yield recorder
        finally:
            self.unsubscribe(recorder)

    def _attach(self) -> None:
        """The hub in the blocks' slot while one is subscribed, else each block's own
        no-op recorder back: the same object, so the fused decoder driver keeps the table
        it built with it (`models.fused_layers`, which checks the slot's identity)."""
        for block, quiet in zip(self.blocks, self._quiet):
            block.stats = self if self._subscribers else quiet


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
    `ExpertStatsHub`). Counts stay on the model's device during a step; `take` reads them
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
