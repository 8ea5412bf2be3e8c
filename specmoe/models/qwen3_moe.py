"""Qwen3-MoE: per-head q/k RMSNorm, no QKV bias, routed experts without a shared expert."""

from __future__ import annotations

from specmoe.config import ArchConfig
from specmoe.models.common import common_fields, qwen_moe_config, reject_sliding_window
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
    fields["moe"] = qwen_moe_config(hf, fields["num_hidden_layers"])
    return ArchConfig(**fields)
