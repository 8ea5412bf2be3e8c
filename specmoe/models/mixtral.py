"""Mixtral (Jiang et al. 2024, arXiv 2401.04088): Llama attention, 8 experts, top-2,
softmax then renormalised top-k weights."""

from __future__ import annotations

from specmoe.config import ArchConfig, MoEConfig
from specmoe.models.common import common_fields, required
from specmoe.models.weight_rules import COMMON_RULES, MIXTRAL_RULES

ARCHITECTURES = ("MixtralForCausalLM",)
WEIGHT_RULES = COMMON_RULES + MIXTRAL_RULES


def parse_config(hf: dict) -> ArchConfig:
    """ArchConfig from a Mixtral config.json dict (every layer is MoE)."""
    fields = common_fields(hf)
    fields["sliding_window"] = hf.get("sliding_window")
    fields["moe"] = MoEConfig(
        num_experts=required(hf, "num_local_experts", "num_experts"),
        top_k=required(hf, "num_experts_per_tok"),
        moe_intermediate_size=fields["intermediate_size"],
        norm_topk_prob=True,
        moe_layers=list(range(fields["num_hidden_layers"])))
    return ArchConfig(**fields)
