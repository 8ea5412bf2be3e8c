"""Dense Llama-style family: Llama, Mistral, Qwen2 (QKV bias), SmolLM2 (a Llama)."""

from __future__ import annotations

from specmoe.config import ArchConfig
from specmoe.models.common import common_fields, reject_sliding_window
from specmoe.models.weight_rules import COMMON_RULES

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
WEIGHT_RULES = COMMON_RULES


def parse_config(hf: dict) -> ArchConfig:
    """ArchConfig from a Llama/Mistral/Qwen2 config.json dict.

    Raises:
        ValueError: for features we do not implement (o_proj or MLP bias, per-layer
            sliding windows of Qwen2).
    """
    fields = common_fields(hf)
    arch = fields["architecture"]
    if arch == "Qwen2ForCausalLM":
        fields["attention_bias"] = True  # q/k/v carry a bias, o_proj does not
        reject_sliding_window(hf)
    elif hf.get("attention_bias"):
        raise ValueError(f"{arch} with attention_bias=true (o_proj bias) is not supported")
    if hf.get("mlp_bias"):
        raise ValueError(f"{arch} with mlp_bias=true is not supported")
    if arch == "MistralForCausalLM":
        fields["sliding_window"] = hf.get("sliding_window")
    return ArchConfig(**fields)
