"""Qwen3 dense: per-head q/k RMSNorm, no QKV bias, explicit head_dim (the natural draft of a
Qwen3-MoE target: the same tokenizer)."""

from __future__ import annotations

from specmoe.config import ArchConfig
from specmoe.models.common import common_fields, reject_sliding_window
from specmoe.models.weight_rules import COMMON_RULES

ARCHITECTURES = ("Qwen3ForCausalLM",)
WEIGHT_RULES = COMMON_RULES


def parse_config(hf: dict) -> ArchConfig:
    """ArchConfig from a Qwen3 config.json dict.

    Raises:
        ValueError: attention_bias=true or per-layer sliding windows (not implemented).
    """
    fields = common_fields(hf)
    reject_sliding_window(hf)
    if hf.get("attention_bias"):
        raise ValueError("Qwen3 with attention_bias=true is not supported")
    fields["qk_norm"] = "per_head"
    return ArchConfig(**fields)
