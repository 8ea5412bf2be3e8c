"""Write a tiny HuggingFace model to a GGUF file the way llama.cpp's converter does.

Test helper (reusable by other tests): `write_gguf_from_hf(model, path, arch)`.

What it mirrors from llama.cpp `convert_hf_to_gguf.py` (and `gguf` package constants):
- metadata keys `{arch}.block_count`, `.context_length`, `.embedding_length`,
  `.feed_forward_length`, `.attention.head_count(_kv)`, `.attention.key_length` (only when
  head_dim != hidden_size / num_heads, like older converters), `.rope.freq_base`,
  `.attention.layer_norm_rms_epsilon`, `.vocab_size`, MoE keys `.expert_count`,
  `.expert_used_count`, `.expert_feed_forward_length`, `.expert_shared_feed_forward_length`,
  `.expert_weights_norm`, and linear `rope.scaling.*`;
- tensor names (`token_embd`, `blk.{i}.attn_q`, ..., `ffn_gate_exps`, ...), experts stacked
  to numpy [num_experts, out, in] (GGUF [in, out, num_experts]);
- `LlamaModel.permute` of q_proj/k_proj rows for arch `llama` (Llama and Mixtral);
- `shared_expert_gate` [1, hidden] written as a vector [hidden];
- Mixtral as arch `llama` with `llama.expert_count` > 0.
Tensors are F32 unless named in `quantized` (GGUF name -> type, via `gguf.quants.quantize`).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers.convert_slow_tokenizer import bytes_to_unicode

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}
_BLOCK_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")

# GGUF architecture per test arch name ("mixtral" is written as llama.cpp does: arch llama).
GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen2moe": "qwen2moe",
             "qwen3": "qwen3", "qwen3moe": "qwen3moe", "olmoe": "olmoe"}

TOKEN_CONTROL = 3  # gguf.TokenType.CONTROL
TOKEN_NORMAL = 1


def hf_checkpoint_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes (checkpoint names, one tensor per expert)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        state_dict: dict[str, torch.Tensor] = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            state_dict.update(load_file(file))
    return state_dict


def llamacpp_permute(weight: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """Copy of llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensors_from_hf(state_dict: Mapping[str, torch.Tensor], config, arch: str) -> dict[str, np.ndarray]:
    """HF checkpoint tensors -> GGUF name -> float32 numpy array (numpy order)."""
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, tensor in state_dict.items():
        array = tensor.detach().to(torch.float32).numpy().copy()
        if hf_name in _GLOBAL_NAMES:
            tensors[_GLOBAL_NAMES[hf_name]] = array
        elif match := _EXPERT_RE.fullmatch(hf_name):
            layer, expert, proj = match.groups()
            experts.setdefault(f"blk.{layer}.{_EXPERT_NAMES[proj]}.weight", {})[int(expert)] = array
        elif match := _BLOCK_RE.fullmatch(hf_name):
            layer, base, kind = match.groups()
            tensors[f"blk.{layer}.{_BLOCK_NAMES[base]}.{kind}"] = _convert_block(array, base, config, arch)
        else:
            raise KeyError(f"no GGUF name for {hf_name}")
    for name, per_expert in experts.items():
        tensors[name] = np.stack([per_expert[e] for e in range(len(per_expert))])  # [E, out, in]
    return tensors


def _convert_block(array: np.ndarray, base: str, config, arch: str) -> np.ndarray:
    if GGUF_ARCH[arch] == "llama" and base == "self_attn.q_proj":
        return llamacpp_permute(array, config.num_attention_heads, config.num_attention_heads)
    if GGUF_ARCH[arch] == "llama" and base == "self_attn.k_proj":
        return llamacpp_permute(array, config.num_attention_heads, config.num_key_value_heads)
    if base == "mlp.shared_expert_gate":
        return array.reshape(-1)  # [1, hidden] -> [hidden]
    return array


def write_gguf_from_hf(
    model: torch.nn.Module,
    path: str | os.PathLike,
    arch: str,
    *,
    quantized: Mapping[str, gguf.GGMLQuantizationType] | None = None,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
    with_tokenizer: bool = True,
) -> dict[str, np.ndarray]:
    """Write `model` (a transformers CausalLM) to a GGUF file at `path`.

    Args:
        arch: one of `GGUF_ARCH` ("llama", "mixtral", "qwen2", "qwen2moe", "qwen3", "qwen3moe",
            "olmoe").
        quantized: GGUF tensor name -> quantisation type (e.g. Q8_0); others are F32.
        extra_tensors: extra GGUF tensors to write as F32 (to test unknown names).
        with_tokenizer: write a tiny byte-level BPE ("gpt2") tokenizer (needs vocab >= 100).

    Returns:
        The F32 tensors written, by GGUF name (before quantisation).
    """
    config = model.config
    writer = gguf.GGUFWriter(path, GGUF_ARCH[arch])
    _add_hparams(writer, config, arch)
    if with_tokenizer:
        add_tiny_tokenizer(writer, config.vocab_size)
    tensors = gguf_tensors_from_hf(hf_checkpoint_state_dict(model), config, arch)
    tensors.update(extra_tensors or {})
    for name, array in tensors.items():
        qtype = (quantized or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def add_core_hparams(writer: gguf.GGUFWriter, config, num_kv_heads: int) -> None:
    """The metadata every llama.cpp architecture writes alike: depth, context, widths,
    head counts (`num_kv_heads`: 1 for MLA's shared latent)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(num_kv_heads)


def _add_hparams(writer: gguf.GGUFWriter, config, arch: str) -> None:
    add_core_hparams(writer, config, config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_moe_hparams(writer, config, arch)


def _add_moe_hparams(writer: gguf.GGUFWriter, config, arch: str) -> None:
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not num_experts:
        return
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "qwen3moe":
        writer.add_expert_weights_norm(config.norm_topk_prob)


def tiny_tokens(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of exactly `vocab_size` tokens: (tokens, types, merges).

    Token 0 is `<|endoftext|>` (bos = eos = 0); then printable ASCII in GPT-2's byte alphabet;
    then "He", "ll", "llo" (so "Hello" -> ["He", "llo"]); then `<|pad_k|>` control tokens.
    """
    spell = bytes_to_unicode()
    tokens = ["<|endoftext|>"] + [spell[b] for b in range(32, 127)] + ["He", "ll", "llo"]
    types = [TOKEN_CONTROL] + [TOKEN_NORMAL] * (len(tokens) - 1)
    if vocab_size < len(tokens):
        raise ValueError(f"tiny tokenizer needs vocab_size >= {len(tokens)}, got {vocab_size}")
    num_pad = vocab_size - len(tokens)
    tokens += [f"<|pad_{k}|>" for k in range(num_pad)]
    types += [TOKEN_CONTROL] * num_pad
    return tokens, types, ["H e", "l l", "ll o"]


def add_tiny_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """Write `tiny_tokens(vocab_size)` as a byte-level BPE ("gpt2") tokenizer, bos = eos = 0."""
    tokens, types, merges = tiny_tokens(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
