"""Qwen1.5/Qwen2-MoE: Qwen2 attention (QKV bias), fine-grained routed experts plus a shared
expert scaled by a sigmoid gate; `norm_topk_prob` off by default."""

from __future__ import annotations

from specmoe.config import ArchConfig
from specmoe.models.common import common_fields, qwen_moe_config, reject_sliding_window
from specmoe.models.weight_rules import COMMON_RULES, QWEN_MOE_RULES

ARCHITECTURES = ("Qwen2MoeForCausalLM",)
WEIGHT_RULES = COMMON_RULES + QWEN_MOE_RULES


def parse_config(hf: dict) -> ArchConfig:
    """ArchConfig from a Qwen2-MoE config.json dict."""
    fields = common_fields(hf)
    reject_sliding_window(hf)
    fields["attention_bias"] = bool(hf.get("qkv_bias", True))  # q/k/v only, never o_proj
    shared = hf.get("shared_expert_intermediate_size") or 0
    fields["moe"] = qwen_moe_config(hf, fields["num_hidden_layers"], shared)
    return ArchConfig(**fields)
