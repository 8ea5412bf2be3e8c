"""DeepSeek-V2 (arXiv 2405.04434) and DeepSeek-V3 (arXiv 2412.19437): Multi-head Latent
Attention (`specmoe.layers.mla`), the first `first_k_dense_replace` layers with a dense
SwiGLU MLP and the rest fine-grained MoE blocks with `n_shared_experts` always-on experts
(one SwiGLU of n_shared_experts * moe_intermediate_size, no gate). V2 routes by softmax,
greedy or group-limited top-k, without renormalising; V3 by sigmoid scores with the
score-correction bias and node-limited groups (noaux_tc), renormalised by default. Both
scale the routed output by routed_scaling_factor.

Matched to transformers' DeepseekV2/V3 modules; where those and DeepSeek's own released
code differ we follow DeepSeek's code or reject the option (see `parse_config`).
"""

from __future__ import annotations

from specmoe.config import ArchConfig, MLAConfig, MoEConfig
from specmoe.models.common import common_fields, required
from specmoe.models.weight_rules import DEEPSEEK_RULES

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
WEIGHT_RULES = DEEPSEEK_RULES


def parse_config(hf: dict) -> ArchConfig:
    """ArchConfig from a DeepSeek-V2 or -V3 config.json dict.

    Raises:
        ValueError: naming the value, for hidden_act other than silu, mlp_bias, a V2
            scoring_func other than softmax or topk_method other than greedy /
            group_limited_greedy, V2 with norm_topk_prob (transformers ignores it,
            DeepSeek's code renormalises instead of scaling), a V3 scoring_func other than
            sigmoid or topk_method other than noaux_tc, or a missing required field.
    """
    fields = common_fields(hf)
    arch = fields["architecture"]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch} with hidden_act={hf['hidden_act']!r} is not supported "
                         "(only silu)")
    if hf.get("mlp_bias"):
        raise ValueError(f"{arch} with mlp_bias=true is not supported")
    v3 = arch == "DeepseekV3ForCausalLM"
    mla = MLAConfig(
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=required(hf, "kv_lora_rank"),
        qk_nope_head_dim=required(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=required(hf, "qk_rope_head_dim"),
        v_head_dim=required(hf, "v_head_dim"),
        # V2's transformers and reference code always rotate interleaved pairs
        rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True)
    fields["mla"] = mla
    # As transformers writes them: head_dim is the RoPE width; MLA expands the latent to
    # every head's keys and values, so there are as many key/value heads as query heads.
    fields["head_dim"] = mla.qk_rope_head_dim
    fields["num_key_value_heads"] = fields["num_attention_heads"]
    fields["attention_bias"] = bool(hf.get("attention_bias", False))
    fields["moe"] = _moe_config(hf, arch, fields["num_hidden_layers"], v3)
    return ArchConfig(**fields)


def _moe_config(hf: dict, arch: str, num_layers: int, v3: bool) -> MoEConfig | None:
    num_experts = hf.get("n_routed_experts")
    if not num_experts:
        return None
    first_dense = hf.get("first_k_dense_replace") or 0
    # DeepSeek's code: MoE where layer_idx >= first_k_dense_replace and layer_idx %
    # moe_layer_freq == 0 (transformers ignores the frequency; every release uses 1).
    freq = hf.get("moe_layer_freq") or 1
    moe_layers = [i for i in range(num_layers) if i >= first_dense and i % freq == 0]
    scoring, methods = ("sigmoid", ("noaux_tc",)) if v3 else (
        "softmax", ("greedy", "group_limited_greedy"))
    if hf.get("scoring_func", scoring) != scoring:
        raise ValueError(f"{arch} with scoring_func={hf['scoring_func']!r} is not supported "
                         f"(only {scoring!r})")
    method = hf.get("topk_method") or methods[0]
    if method not in methods:
        raise ValueError(f"{arch} with topk_method={method!r} is not supported: choose one "
                         f"of {methods}")
    norm = bool(hf.get("norm_topk_prob", v3))
    if norm and not v3:
        raise ValueError(f"{arch} with norm_topk_prob=true is not supported (transformers "
                         "ignores it, DeepSeek-V2's code renormalises instead of scaling)")
    grouped = method != "greedy"
    moe_size = required(hf, "moe_intermediate_size")
    return MoEConfig(
        num_experts=num_experts,
        top_k=required(hf, "num_experts_per_tok"),
        moe_intermediate_size=moe_size,
        norm_topk_prob=norm,
        shared_expert_intermediate_size=(hf.get("n_shared_experts") or 0) * moe_size,
        moe_layers=moe_layers,
        scoring_func=scoring,
        topk_method=method,
        n_group=required(hf, "n_group") if grouped else 1,
        topk_group=required(hf, "topk_group") if grouped else 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0))
