"""Choosing the routed-expert implementation and the expert-stats recorder, once, by
composition (no flag in the hot path)."""

from __future__ import annotations

from torch import nn

from specmoe.layers.moe.block import SparseMoEBlock
from specmoe.layers.moe.experts import RoutedExperts

MOE_BACKENDS = {
    "grouped": RoutedExperts.forward,
    "reference": RoutedExperts.forward_reference,
}


def set_moe_backend(model: nn.Module, name: str) -> None:
    """Use backend `name` ("grouped" or "reference") in every MoE block of `model`.

    Raises:
        ValueError: for an unknown backend name.
    """
    if name not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}: choose one of {sorted(MOE_BACKENDS)}")
    for block in moe_blocks(model):
        block.run_experts = MOE_BACKENDS[name].__get__(block.experts)


def set_expert_stats(model: nn.Module, recorder) -> None:
    """Attach `recorder` (with `record(layer_idx, topk_ids, topk_weights)`, see
    `specmoe.layers.moe.stats`) to every MoE block."""
    for block in moe_blocks(model):
        block.stats = recorder


def moe_blocks(model: nn.Module) -> list[SparseMoEBlock]:
    """All MoE blocks of `model`, in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoEBlock)]
