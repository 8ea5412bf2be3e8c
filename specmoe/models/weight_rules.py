"""Declarative mapping tables from HuggingFace checkpoint names to `DecoderModel` parameters.

A rule is (regex over the checkpoint name, target parameter template, shard, expert group):
the template uses the regex's groups; `shard` is the index of a fused parameter's row shard
(q/k/v of `qkv_proj`, gate/up of `gate_up_proj` and of the experts' `w13`); an expert rule
takes the expert index from a named group `e`.
"""

from __future__ import annotations

from dataclasses import dataclass
import re


@dataclass(frozen=True)
class WeightRule:
    pattern: re.Pattern
    target: str
    shard: int | None = None


def rule(pattern: str, target: str, shard: int | None = None) -> WeightRule:
    return WeightRule(re.compile(pattern + r"$"), target, shard)


_L = r"model\.layers\.(?P<l>\d+)\."

COMMON_RULES = [
    rule(r"model\.embed_tokens\.weight", "embed_tokens.weight"),
    rule(r"model\.norm\.weight", "norm.weight"),
    rule(r"lm_head\.weight", "lm_head.proj.weight"),
    rule(_L + r"input_layernorm\.weight", "layers.{l}.input_norm.weight"),
    rule(_L + r"post_attention_layernorm\.weight", "layers.{l}.post_attn_norm.weight"),
    rule(_L + r"self_attn\.q_proj\.(?P<p>weight|bias)", "layers.{l}.attn.qkv_proj.{p}", 0),
    rule(_L + r"self_attn\.k_proj\.(?P<p>weight|bias)", "layers.{l}.attn.qkv_proj.{p}", 1),
    rule(_L + r"self_attn\.v_proj\.(?P<p>weight|bias)", "layers.{l}.attn.qkv_proj.{p}", 2),
    rule(_L + r"self_attn\.o_proj\.weight", "layers.{l}.attn.o_proj.weight"),
    rule(_L + r"self_attn\.q_norm\.weight", "layers.{l}.attn.q_norm.weight"),
    rule(_L + r"self_attn\.k_norm\.weight", "layers.{l}.attn.k_norm.weight"),
    rule(_L + r"mlp\.gate_proj\.weight", "layers.{l}.mlp.gate_up_proj.weight", 0),
    rule(_L + r"mlp\.up_proj\.weight", "layers.{l}.mlp.gate_up_proj.weight", 1),
    rule(_L + r"mlp\.down_proj\.weight", "layers.{l}.mlp.down_proj.weight"),
]

def _moe_rules(shared: str) -> list[WeightRule]:
    """The router gate, the routed experts one by one, and the shared expert, which the
    checkpoint calls `shared` (Qwen: "shared_expert", DeepSeek: "shared_experts")."""
    experts, sh = _L + r"mlp\.experts\.(?P<e>\d+)\.", _L + r"mlp\." + shared + r"\."
    target = "layers.{l}.mlp.shared_expert."
    return [
        rule(_L + r"mlp\.gate\.weight", "layers.{l}.mlp.router.gate.weight"),
        rule(experts + r"gate_proj\.weight", "layers.{l}.mlp.experts.w13", 0),
        rule(experts + r"up_proj\.weight", "layers.{l}.mlp.experts.w13", 1),
        rule(experts + r"down_proj\.weight", "layers.{l}.mlp.experts.w2"),
        rule(sh + r"gate_proj\.weight", target + "gate_up_proj.weight", 0),
        rule(sh + r"up_proj\.weight", target + "gate_up_proj.weight", 1),
        rule(sh + r"down_proj\.weight", target + "down_proj.weight"),
    ]


# Qwen2-MoE, Qwen3-MoE and OLMoE name their MoE blocks alike.
QWEN_MOE_RULES = _moe_rules("shared_expert") + [
    rule(_L + r"mlp\.shared_expert_gate\.weight", "layers.{l}.mlp.shared_expert_gate.weight"),
]

MIXTRAL_RULES = [
    rule(_L + r"block_sparse_moe\.gate\.weight", "layers.{l}.mlp.router.gate.weight"),
    rule(_L + r"block_sparse_moe\.experts\.(?P<e>\d+)\.w1\.weight",
         "layers.{l}.mlp.experts.w13", 0),
    rule(_L + r"block_sparse_moe\.experts\.(?P<e>\d+)\.w3\.weight",
         "layers.{l}.mlp.experts.w13", 1),
    rule(_L + r"block_sparse_moe\.experts\.(?P<e>\d+)\.w2\.weight",
         "layers.{l}.mlp.experts.w2"),
]

# DeepSeek-V2/V3: the norms, embeddings, head and dense MLPs of COMMON_RULES; Multi-head
# Latent Attention (`specmoe.layers.mla`); MoE blocks with a router score-correction bias
# (V3) and `shared_experts` (plural, no gate). transformers' save_pretrained writes the
# routed experts one by one, under the names below.
_MLA = _L + r"self_attn\."
DEEPSEEK_RULES = [r for r in COMMON_RULES if "self_attn" not in r.pattern.pattern] + [
    rule(_MLA + r"q_proj\.weight", "layers.{l}.attn.q_proj.weight"),
    rule(_MLA + r"q_a_proj\.(?P<p>weight|bias)", "layers.{l}.attn.q_a_proj.{p}"),
    rule(_MLA + r"q_a_layernorm\.weight", "layers.{l}.attn.q_a_layernorm.weight"),
    rule(_MLA + r"q_b_proj\.weight", "layers.{l}.attn.q_b_proj.weight"),
    rule(_MLA + r"kv_a_proj_with_mqa\.(?P<p>weight|bias)",
         "layers.{l}.attn.kv_a_proj_with_mqa.{p}"),
    rule(_MLA + r"kv_a_layernorm\.weight", "layers.{l}.attn.kv_a_layernorm.weight"),
    rule(_MLA + r"kv_b_proj\.weight", "layers.{l}.attn.kv_b_proj.weight"),
    rule(_MLA + r"o_proj\.(?P<p>weight|bias)", "layers.{l}.attn.o_proj.{p}"),
    rule(_L + r"mlp\.gate\.e_score_correction_bias",
         "layers.{l}.mlp.router.e_score_correction_bias"),
    *_moe_rules("shared_experts"),
]

# Checkpoint entries that carry no weights we need (derived buffers).
IGNORED = [re.compile(r".*rotary_emb\.inv_freq$")]
