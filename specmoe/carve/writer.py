"""Write a carved model as a HuggingFace Qwen2-MoE directory: config.json, model.safetensors
(per-expert tensor names, as Qwen1.5-MoE checkpoints have them), the tokenizer files.
Layers that were not carved stay dense (`mlp_only_layers`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specmoe.carve.dense import DenseCheckpoint
from specmoe.models.common import rope_fields


def qwen2_moe_config(ckpt: DenseCheckpoint, carved: dict, settings) -> dict:
    """The Qwen2MoeForCausalLM config.json of the carved model.

    Raises:
        ValueError: a source whose attention Qwen2-MoE cannot express (o_proj bias).
    """
    src = ckpt.config
    has_bias = "model.layers.0.self_attn.q_proj.bias" in ckpt.tensors
    if "model.layers.0.self_attn.o_proj.bias" in ckpt.tensors:
        raise ValueError("cannot write Qwen2-MoE: the source's o_proj has a bias")
    width = ckpt.intermediate_size // (settings.num_experts + settings.shared_experts)
    eos = src.get("eos_token_id")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "bos_token_id")
    config = {k: src[k] for k in keep if k in src}
    config.update({
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "hidden_act": "silu", "qkv_bias": has_bias, "rope_theta": rope_fields(src)[0], "eos_token_id": eos,
        "num_experts": settings.num_experts, "num_experts_per_tok": settings.top_k,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width * settings.shared_experts,
        "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": sorted(set(range(ckpt.num_layers)) - set(carved)),
        "use_sliding_window": False, "torch_dtype": settings.dtype,
        "tie_word_embeddings": bool(src.get("tie_word_embeddings", False)),
    })
    if src.get("head_dim"):
        config["head_dim"] = src["head_dim"]
    return config


def checkpoint_tensors(ckpt: DenseCheckpoint, carved: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the carved model, float32: the source's, with each carved layer's
    dense FFN replaced by its MoE tensors."""
    out = {}
    for name, t in ckpt.tensors.items():
        parts = name.split(".")
        if (len(parts) > 4 and parts[1] == "layers" and parts[3] == "mlp"
                and int(parts[2]) in carved):
            continue
        if name == "lm_head.weight" and ckpt.config.get("tie_word_embeddings"):
            continue
        out[name] = t
    for index, layer in carved.items():
        out.update(layer.hf_tensors(f"model.layers.{index}.mlp."))
    return {k: v for k, v in out.items() if v.numel()}


def write_checkpoint(ckpt: DenseCheckpoint, carved: dict, settings, out: Path,
                     tokenizer) -> None:
    """config.json, model.safetensors (in settings.dtype) and the tokenizer into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, settings.dtype)
    tensors = {k: v.to(dtype).contiguous() for k, v in checkpoint_tensors(ckpt, carved).items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(
        json.dumps(qwen2_moe_config(ckpt, carved, settings), indent=1) + "\n")
    tokenizer.save_pretrained(str(out))
