"""Choosing the routed-expert implementation and the expert-stats recorder, once, by
composition (no flag in the hot path)."""

from __future__ import annotations

import torch
from torch import nn

from specmoe.config import MOE_BACKEND_CHOICES
from specmoe.layers.moe.block import SparseMoEBlock
from specmoe.layers.moe.experts import RoutedExperts
from specmoe.layers.moe.stats import ExpertStatsHub

MOE_BACKENDS = {
    "fused": RoutedExperts.forward_fused,
    "grouped": RoutedExperts.forward,
    "grouped_mm": RoutedExperts.forward_grouped_mm,
    "reference": RoutedExperts.forward_reference,
}
PACKED_BACKENDS = ("fused", "grouped")  # those that read the experts' packed copies


def resolve_moe_backend(name: str, device: torch.device, native_kernels: bool) -> str:
    """The backend `name` stands for: "auto" is "fused" on a CPU where the native decode
    kernels run (the whole layer in one call on the experts' packed weights; it falls back
    to "grouped", the loop over active experts, where its own kernel does not apply) and
    "grouped_mm" elsewhere (CUDA, or a CPU without the kernels: no Python loop over experts).

    Raises:
        ValueError: for an unknown backend name.
    """
    if name not in MOE_BACKEND_CHOICES:
        raise ValueError(f"invalid moe_backend={name!r}: choose one of "
                         f"{list(MOE_BACKEND_CHOICES)}")
    if name != "auto":
        return name
    return "fused" if device.type == "cpu" and native_kernels else "grouped_mm"


def set_moe_backend(model: nn.Module, name: str) -> None:
    """Use backend `name` ("fused", "grouped", "grouped_mm" or "reference") in every MoE
    block of `model`.

    Only "fused" and "grouped" read the native kernels' packed copies: under the others the
    experts keep their dense weights (choose the backend before `prepack_weights` releases
    them).

    Raises:
        ValueError: for an unknown backend name, or one that needs dense weights already
            released.
    """
    if name not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}: choose one of {sorted(MOE_BACKENDS)}")
    for block in moe_blocks(model):
        experts = block.experts
        dense = getattr(experts, "w13", None)  # quantised experts have no dense weights
        if name not in PACKED_BACKENDS and dense is not None and dense.is_meta:
            raise ValueError(f"MoE backend {name!r} needs the experts' dense weights, which "
                             "were released for the native kernel")
        experts.reads_packed = name in PACKED_BACKENDS
        # by name: quantised experts (`specmoe.layers.quantization.QuantizedRoutedExperts`)
        # have their own methods of these names
        block.run_experts = getattr(experts, MOE_BACKENDS[name].__name__)


def expert_stats(model: nn.Module) -> ExpertStatsHub:
    """The model's expert-stats hub (`specmoe.layers.moe.stats`), made on first use: recorders
    subscribe to it instead of taking the MoE blocks' `stats` slot."""
    hub = model.__dict__.get("_expert_stats_hub")
    if hub is None:
        hub = ExpertStatsHub(moe_blocks(model))
        model.__dict__["_expert_stats_hub"] = hub
    return hub


def moe_blocks(model: nn.Module) -> list[SparseMoEBlock]:
    """All MoE blocks of `model`, in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoEBlock)]
