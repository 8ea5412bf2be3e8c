"""GGUF tensor names -> HuggingFace checkpoint names, per model family.

The tables `GGUFCheckpoint` (`specmoe.loader.gguf_file`) plans a file's tensors with. GGUF
names are llama.cpp's (`gguf.TENSOR_NAMES`: `blk.{i}.attn_q`, `blk.{i}.ffn_gate_exps`, ...);
HF names are the ones transformers' `save_pretrained` writes, one tensor per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

# Tensors llama.cpp writes that are not HuggingFace checkpoint weights; they are skipped.
# - `rope_freqs`: per-dimension rotary frequency divisors [head_dim // 2] that the converter
#   computes from `rope_scaling` (Llama 3.x "llama3" rope type); HF recomputes them from the
#   config. It is exposed as `GGUFCheckpoint.rope_freq_factors` since the GGUF metadata does
#   not keep the llama3 rope_scaling parameters.
# - `blk.{i}.attn_rot_embd`: the rotary `inv_freq` buffer of old converters, recomputed by HF.
SKIPPED_GLOBAL = frozenset({"rope_freqs.weight"})
SKIPPED_BLOCK = frozenset({"attn_rot_embd"})

GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF block tensor base name -> HF name under `model.layers.{i}.` (without .weight/.bias).
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_ROUTER = {"ffn_gate_inp": "mlp.gate"}
_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Stacked experts [num_experts, out, in] -> HF per-expert name template.
_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_MIXTRAL_ROUTER = {"ffn_gate_inp": "block_sparse_moe.gate"}
_MIXTRAL_EXPERTS = {
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
}
# Old llama.cpp Mixtral files store one tensor per expert: `blk.{i}.ffn_gate.{e}.weight`.
LEGACY_EXPERT_BASES = {"ffn_gate": "ffn_gate_exps", "ffn_up": "ffn_up_exps", "ffn_down": "ffn_down_exps"}

# DeepSeek-V2/V3 (llama.cpp arch `deepseek2`, converter `DeepseekV2Model`, no q/k row
# permutation): Multi-head Latent Attention, dense first layers, shared experts (plural, no
# gate). kv_b_proj is `attn_kv_b` in older files; newer ones split it into `attn_k_b` and
# `attn_v_b` (merged back by `gguf_deepseek2.merge_kv_b`).
_MLA = {
    "attn_q": "self_attn.q_proj",  # without a query LoRA (DeepSeek-V2-Lite)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_SHARED_EXPERTS = {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# DeepSeek-V3's router score-correction bias: `blk.{i}.exp_probs_b.bias` in GGUF, a buffer
# with a whole name (no .weight/.bias) in HF.
_SCORE_BIAS = {"exp_probs_b": "mlp.gate.e_score_correction_bias"}


@dataclass(frozen=True, slots=True)
class Family:
    """How one model family maps from GGUF to HuggingFace."""

    hf_architecture: str
    model_type: str
    block_names: dict[str, str]
    expert_names: dict[str, str]
    is_rope_permuted: bool  # llama.cpp permuted q/k rows (LlamaModel.permute)
    whole_names: dict[str, str] | None = None  # block base -> whole HF name (no .weight/.bias)
    has_split_kv_b: bool = False  # MLA kv_b_proj may come as attn_k_b + attn_v_b


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", _ATTENTION | _DENSE_MLP, {}, True),
    "mixtral": Family("MixtralForCausalLM", "mixtral", _ATTENTION | _MIXTRAL_ROUTER, _MIXTRAL_EXPERTS, True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", _ATTENTION | _DENSE_MLP, {}, False),
    "qwen2moe": Family(
        "Qwen2MoeForCausalLM", "qwen2_moe", _ATTENTION | _DENSE_MLP | _ROUTER | _SHARED_EXPERT, _EXPERTS, False
    ),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", _ATTENTION | _QK_NORM | _DENSE_MLP, {}, False),
    "qwen3moe": Family(
        "Qwen3MoeForCausalLM", "qwen3_moe", _ATTENTION | _QK_NORM | _DENSE_MLP | _ROUTER, _EXPERTS, False
    ),
    "olmoe": Family("OlmoeForCausalLM", "olmoe", _ATTENTION | _QK_NORM | _ROUTER, _EXPERTS, False),
    # DeepSeek-V3 files are `deepseek2` too: `gguf_deepseek2.deepseek2_config` tells them apart
    "deepseek2": Family(
        "DeepseekV2ForCausalLM", "deepseek_v2", _MLA | _DENSE_MLP | _ROUTER | _SHARED_EXPERTS, _EXPERTS, False,
        whole_names=_SCORE_BIAS, has_split_kv_b=True,
    ),
}
