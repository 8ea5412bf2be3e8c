"""Write a tiny transformers DeepSeek-V2/V3 model to a `deepseek2` GGUF file as llama.cpp does.

Test helper: `write_deepseek2_gguf(model, path)`. What it mirrors from llama.cpp
`convert_hf_to_gguf.py` (`TextModel.set_gguf_parameters` and `DeepseekV2Model`):
- tensor names from the `gguf` package's own map (`gguf.get_tensor_name_map(DEEPSEEK2)`),
  after the converter's renames: `e_score_correction_bias` -> `e_score_correction.bias`
  (`exp_probs_b.bias`), experts stacked to numpy [E, out, in] under
  `model.layers.{i}.mlp.experts.{proj}.weight` (`ffn_*_exps`);
- no q/k row permutation; lm_head left out when tied;
- kv_b_proj split per head (`split_kv_b=True`, the converter since MLA absorption) into
  `attn_k_b` = W_UK transposed [H, kv_lora_rank, qk_nope] and `attn_v_b` = W_UV
  [H, v, kv_lora_rank], or kept as `attn_kv_b` (older converters);
- metadata: head_count_kv 1; key/value_length kv_lora_rank + qk_rope / kv_lora_rank with
  key/value_length_mla qk_nope + qk_rope / v (split) or just key/value_length qk_nope + qk_rope /
  v (older); expert_gating_func from the scoring function (DeepSeek's config.json says softmax
  for V2, sigmoid for V3; transformers' config has no field for it); expert_group_count /
  _used_count when n_group is set; expert_weights_norm only when true; YaRN type, factor,
  original context, betas and yarn_log_multiplier = 0.1 * mscale_all_dim.
`omit` leaves out metadata keys or tensors (full names), to test missing ones.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection

import gguf
import numpy as np
import torch
from gguf_writer import add_core_hparams, add_tiny_tokenizer, hf_checkpoint_state_dict

ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2]  # "deepseek2"
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_KV_B = re.compile(r"model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight")


def write_deepseek2_gguf(model: torch.nn.Module, path: str | os.PathLike, *, split_kv_b: bool = True,
                         omit: Collection[str] = ()) -> None:
    """Write `model` (a transformers DeepseekV2/V3ForCausalLM) as F32 tensors to `path`."""
    config = model.config
    writer = gguf.GGUFWriter(path, ARCH)
    _add_hparams(writer, config, split_kv_b)
    add_tiny_tokenizer(writer, config.vocab_size)
    tensors = deepseek2_tensors(model, split_kv_b)
    for name in omit:  # a metadata key or a tensor; KeyError for neither
        writer.kv_data[0].pop(name, None) if name in writer.kv_data[0] else tensors.pop(name)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def deepseek2_tensors(model: torch.nn.Module, split_kv_b: bool) -> dict[str, np.ndarray]:
    """GGUF name -> float32 numpy array (numpy order), as the converter writes them."""
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config.num_hidden_layers)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    hf_tensors: dict[str, np.ndarray] = {}
    for hf_name, tensor in hf_checkpoint_state_dict(model).items():
        array = tensor.detach().to(torch.float32).numpy().copy()
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        if match := _EXPERT.fullmatch(hf_name):
            layer, expert, proj = match.groups()
            experts.setdefault((int(layer), proj), {})[int(expert)] = array
        elif split_kv_b and (match := _KV_B.fullmatch(hf_name)):
            prefix = f"model.layers.{match[1]}.self_attn."
            hf_tensors[prefix + "k_b_proj.weight"], hf_tensors[prefix + "v_b_proj.weight"] = _split_kv_b(array, config)
        else:
            hf_tensors[hf_name.replace("e_score_correction_bias", "e_score_correction.bias")] = array
    for (layer, proj), per_expert in experts.items():
        stacked = np.stack([per_expert[e] for e in range(len(per_expert))])  # [E, out, in]
        hf_tensors[f"model.layers.{layer}.mlp.experts.{proj}.weight"] = stacked
    out = {}
    for hf_name, array in hf_tensors.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"no GGUF name for {hf_name}")
        out[gguf_name] = array
    return out


def _split_kv_b(kv_b: np.ndarray, config) -> tuple[np.ndarray, np.ndarray]:
    """The converter's split: view [H, qk_nope + v, rank], k_b = key rows transposed."""
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    per_head = kv_b.reshape(heads, nope + v, kv_b.shape[-1])
    return np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(per_head[:, nope:])


def _add_hparams(writer: gguf.GGUFWriter, config, split_kv_b: bool) -> None:
    add_core_hparams(writer, config, 1)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_mla(writer, config, split_kv_b)
    _add_moe(writer, config)
    _add_rope(writer, config)


def _add_mla(writer: gguf.GGUFWriter, config, split_kv_b: bool) -> None:
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    if split_kv_b:
        writer.add_key_length(rank + rope)
        writer.add_value_length(rank)
        writer.add_key_length_mla(config.qk_nope_head_dim + rope)
        writer.add_value_length_mla(config.v_head_dim)
    else:
        writer.add_key_length(config.qk_nope_head_dim + rope)
        writer.add_value_length(config.v_head_dim)
    writer.add_rope_dimension_count(rope)


def _add_moe(writer: gguf.GGUFWriter, config) -> None:
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if config.n_group is not None:
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    v3 = config.model_type == "deepseek_v3"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)


def _add_rope(writer: gguf.GGUFWriter, config) -> None:
    rope = config.rope_parameters
    if rope.get("rope_type") != "yarn":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if rope.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
