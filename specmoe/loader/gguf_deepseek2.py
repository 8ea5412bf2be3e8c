"""llama.cpp's `deepseek2` GGUF architecture (DeepSeek-V2 and -V3) as a HuggingFace config.

What llama.cpp's converter (`convert_hf_to_gguf.py`, `DeepseekV2Model`) writes, and how it
maps back to the `config.json` fields `specmoe.models.deepseek.parse_config` reads:

- `{arch}.attention.head_count_kv` is 1 (llama.cpp runs MLA as multi-query attention over the
  latent); HF has as many key/value heads as query heads, and head_dim = qk_rope_head_dim.
- `attention.key_length_mla` / `value_length_mla` are qk_nope + qk_rope and v_head_dim in files
  written since the converter split kv_b (their `key_length` / `value_length` are then the
  latent widths kv_lora_rank + qk_rope and kv_lora_rank); older files have no `_mla` keys and
  put qk_nope + qk_rope and v_head_dim in `key_length` / `value_length`.
- `rope.dimension_count` is qk_rope_head_dim; llama.cpp rotates interleaved pairs (its NORM
  rope) and does not permute rows, so the file is DeepSeek's own (interleaved) layout.
- `expert_gating_func` 2 (sigmoid) is DeepSeek-V3 (noaux_tc routing with the `exp_probs_b`
  score-correction bias); 1 (softmax), or no key (V2 files written before the key existed),
  is DeepSeek-V2: greedy top-k, or group-limited greedy when `expert_group_count` > 1.
- `expert_weights_norm` (written only when true), `expert_weights_scale`
  (routed_scaling_factor, 1 when absent), `expert_shared_count`, `leading_dense_block_count`
  (first_k_dense_replace; every later layer is MoE), `expert_feed_forward_length`.
- YaRN: `rope.scaling.yarn_log_multiplier` is 0.1 * mscale_all_dim; llama.cpp assumes
  mscale == mscale_all_dim (cos/sin unscaled), as DeepSeek's releases set them.

`attn_kv_b` [H * (qk_nope + v), kv_lora_rank] is HF's kv_b_proj; newer files instead hold
`attn_k_b` (per head W_UK transposed) and `attn_v_b` (W_UV), which `merge_kv_b` joins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # gguf.ExpertGatingFuncType

ArchKey = Callable[..., Any]  # (suffix, default=None) -> value of `{arch}.{suffix}`
RequiredKey = Callable[[str], Any]  # suffix -> value; raises ValueError naming the key


def deepseek2_config(path: str, key: ArchKey, required: RequiredKey,
                     rope_scaling: dict | None) -> dict[str, Any]:
    """The DeepSeek fields of a GGUF file's HuggingFace config dict.

    Args:
        path: the file, for error messages.
        key: `key(suffix, default)` reads metadata `deepseek2.{suffix}`.
        required: `required(suffix)` reads it or raises ValueError naming the key.
        rope_scaling: the generic rope scaling dict read from the file (None: none); a YaRN
            one gets DeepSeek's beta_fast/beta_slow and mscale/mscale_all_dim.

    Returns:
        architectures, model_type, num_key_value_heads, head_dim, hidden_act, the MLA widths,
        the MoE fields (none when `expert_count` is 0 or absent) and rope_scaling (when set).

    Raises:
        ValueError: a required key is missing (`attention.kv_lora_rank`,
            `rope.dimension_count`, the key/value lengths, and with experts
            `expert_used_count`, `expert_feed_forward_length`), or `expert_gating_func` is
            neither 1 (softmax) nor 2 (sigmoid).
    """
    gating = key("expert_gating_func", GATING_SOFTMAX)
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise ValueError(f"{path}: unsupported 'deepseek2.expert_gating_func' {gating}: supported "
                         f"{GATING_SOFTMAX} (softmax, DeepSeek-V2), {GATING_SIGMOID} (sigmoid, DeepSeek-V3)")
    v3 = gating == GATING_SIGMOID
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "num_key_value_heads": required("attention.head_count"),
        "hidden_act": "silu",
    }
    config.update(_mla_config(key, required))
    config["head_dim"] = config["qk_rope_head_dim"]
    if v3:
        config["rope_interleave"] = True
    config.update(_moe_config(key, required, v3))
    if rope_scaling is not None:
        config["rope_scaling"] = _yarn_fields(key, rope_scaling)
    return config


def _mla_config(key: ArchKey, required: RequiredKey) -> dict[str, Any]:
    rope = required("rope.dimension_count")
    suffix = "_mla" if key("attention.key_length_mla") is not None else ""
    qk_head_dim = required(f"attention.key_length{suffix}")
    return {
        "q_lora_rank": key("attention.q_lora_rank") or None,  # absent or 0: one q_proj
        "kv_lora_rank": required("attention.kv_lora_rank"),
        "qk_nope_head_dim": qk_head_dim - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": required(f"attention.value_length{suffix}"),
    }


def _moe_config(key: ArchKey, required: RequiredKey, v3: bool) -> dict[str, Any]:
    num_experts = key("expert_count") or 0
    if num_experts == 0:
        return {}
    n_group = key("expert_group_count") or 1
    topk_group = required("expert_group_used_count") if n_group > 1 else 1
    method = "noaux_tc" if v3 else ("group_limited_greedy" if n_group > 1 else "greedy")
    return {
        "n_routed_experts": num_experts,
        "num_experts_per_tok": required("expert_used_count"),
        "moe_intermediate_size": required("expert_feed_forward_length"),
        "n_shared_experts": key("expert_shared_count", 0),
        "first_k_dense_replace": key("leading_dense_block_count", 0),
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": method,
        "n_group": n_group,
        "topk_group": topk_group,
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
    }


def _yarn_fields(key: ArchKey, rope_scaling: dict) -> dict:
    if rope_scaling.get("rope_type") != "yarn":
        return rope_scaling
    scaling = dict(rope_scaling)
    for name in ("beta_fast", "beta_slow"):
        if (value := key(f"rope.scaling.yarn_{name}")) is not None:
            scaling[name] = float(value)
    if log_mul := key("rope.scaling.yarn_log_multiplier"):
        # stored as float32: round off its last bits (0.0707 -> 0.707, not 0.7069999...)
        scaling["mscale"] = scaling["mscale_all_dim"] = round(float(log_mul) / 0.1, 6)
    return scaling


def merge_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """HF's kv_b_proj weight from llama.cpp's split `attn_k_b` and `attn_v_b`.

    The converter views kv_b_proj [H * (qk_nope + v), kv_lora_rank] as [H, qk_nope + v,
    kv_lora_rank], splits each head's key rows (W_UK) from its value rows (W_UV) and
    transposes W_UK; this undoes it.

    Args:
        k_b: [H, kv_lora_rank, qk_nope_head_dim] (numpy order; GGUF shape reversed).
        v_b: [H, v_head_dim, kv_lora_rank].

    Returns:
        [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank], same dtype, contiguous.

    Raises:
        ValueError: the shapes are not 3-D with matching heads and kv_lora_rank.
    """
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"attn_k_b {k_b.shape} and attn_v_b {v_b.shape} do not split one kv_b: expected "
                         "[heads, kv_lora_rank, qk_nope_head_dim] and [heads, v_head_dim, kv_lora_rank]")
    kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # [H, qk_nope + v, rank]
    return np.ascontiguousarray(kv_b.reshape(-1, k_b.shape[1]))
