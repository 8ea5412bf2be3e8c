"""OLMoE (Muennighoff et al. 2024, arXiv 2409.02060): q/k RMSNorm over the whole projection,
optional q/k/v clipping, 64 experts top-8, every layer MoE."""

from __future__ import annotations

from specmoe.config import ArchConfig, MoEConfig
from specmoe.models.common import common_fields, required
from specmoe.models.weight_rules import COMMON_RULES, QWEN_MOE_RULES

ARCHITECTURES = ("OlmoeForCausalLM",)
WEIGHT_RULES = COMMON_RULES + QWEN_MOE_RULES


def parse_config(hf: dict) -> ArchConfig:
    """ArchConfig from an OLMoE config.json dict (`intermediate_size` is the expert width)."""
    fields = common_fields(hf)
    if hf.get("attention_bias"):
        raise ValueError("OLMoE with attention_bias=true is not supported")
    fields["qk_norm"] = "full"
    fields["clip_qkv"] = hf.get("clip_qkv")
    fields["moe"] = MoEConfig(
        num_experts=required(hf, "num_experts", "num_local_experts"),
        top_k=required(hf, "num_experts_per_tok"),
        moe_intermediate_size=fields["intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=list(range(fields["num_hidden_layers"])))
    return ArchConfig(**fields)
