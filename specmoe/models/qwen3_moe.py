"""Qwen3-MoE: per-head q/k RMSNorm, no QKV bias, routed experts without a shared expert."""

from __future__ import annotations

from specmoe.config import ArchConfig, MoEConfig
from specmoe.models.common import (common_fields, reject_sliding_window, required,
                                   sparse_layers)
from specmoe.models.weight_rules import COMMON_RULES, QWEN_MOE_RULES

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
WEIGHT_RULES = COMMON_RULES + QWEN_MOE_RULES


def parse_config(hf: dict) -> ArchConfig:
    """ArchConfig from a Qwen3-MoE config.json dict."""
    fields = common_fields(hf)
    reject_sliding_window(hf)
    if hf.get("attention_bias"):
        raise ValueError("Qwen3-MoE with attention_bias=true is not supported")
    fields["qk_norm"] = "per_head"
    fields["moe"] = MoEConfig(
        num_experts=required(hf, "num_experts", "num_local_experts"),
        top_k=required(hf, "num_experts_per_tok"),
        moe_intermediate_size=required(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=sparse_layers(hf, fields["num_hidden_layers"]))
    return ArchConfig(**fields)
