"""Write a study preset (`analysis.presets`) as a HuggingFace checkpoint with random weights,
so that every tool that loads a model (generate, serve, `bench throughput`, expert
parallelism across processes) runs a MoE of the preset's real shape: Mixtral's layout for
the grouped-query MoE presets (Llama attention, softmax top-k renormalised, no shared
expert), Llama's for the dense ones. DeepSeek-shaped presets (MLA, shared experts, dense
first layers) are refused: Mixtral cannot express them.

The weights are N(0, 1/fan_in) values tiled from one seeded pool (`presets.fill_synthetic_`'s
recipe), norms ones. The vocabulary is the tokenizer's (copied from `tokenizer_from`, the
bundled tiny-moe's by default), rounded up to a multiple of 64, in place of the preset's:
its prompts must encode and its outputs decode. One safetensors shard per decoder layer
keeps the writer's memory to one layer.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from specmoe.analysis.presets import HEAD_DIM, Preset

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
POOL_SIZE = 1 << 20


def hf_config(preset: Preset, vocab_size: int) -> dict:
    """config.json of the preset as MixtralForCausalLM (MoE) or LlamaForCausalLM (dense).

    Raises:
        ValueError: a preset Mixtral cannot express (MLA, shared experts, dense first layers).
    """
    if preset.mla is not None or preset.shared_experts or preset.first_dense_layers:
        raise ValueError(f"preset {preset.name} has MLA, shared experts or dense first "
                         "layers, which the Mixtral layout cannot express")
    arch = preset.arch()
    config = {
        "vocab_size": vocab_size, "hidden_size": arch.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads, "head_dim": HEAD_DIM,
        "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    if not preset.is_moe:
        return {**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    return {**config, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "num_local_experts": preset.num_experts,
            "num_experts_per_tok": preset.top_k, "sliding_window": None}


def layer_shapes(preset: Preset, config: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of one decoder layer."""
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], \
        config["num_key_value_heads"]
    p = f"model.layers.{layer}."
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
              p + "self_attn.q_proj.weight": (heads * HEAD_DIM, h),
              p + "self_attn.k_proj.weight": (kv * HEAD_DIM, h),
              p + "self_attn.v_proj.weight": (kv * HEAD_DIM, h),
              p + "self_attn.o_proj.weight": (h, heads * HEAD_DIM)}
    width = config["intermediate_size"]
    if not preset.is_moe:
        return {**shapes, p + "mlp.gate_proj.weight": (width, h),
                p + "mlp.up_proj.weight": (width, h), p + "mlp.down_proj.weight": (h, width)}
    moe = p + "block_sparse_moe."
    shapes[moe + "gate.weight"] = (preset.num_experts, h)
    for e in range(preset.num_experts):
        shapes.update({f"{moe}experts.{e}.w1.weight": (width, h),
                       f"{moe}experts.{e}.w3.weight": (width, h),
                       f"{moe}experts.{e}.w2.weight": (h, width)})
    return shapes


class _Filler:
    """Tensors of N(0, 1/fan_in) values tiled from one seeded pool (norm weights ones)."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(POOL_SIZE, generator=self.gen)
        self.dtype = dtype

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape, dtype=self.dtype)
        numel = math.prod(shape)
        offset = int(torch.randint(0, POOL_SIZE, (1,), generator=self.gen))
        chunk = torch.roll(self.pool, offset) / math.sqrt(shape[-1])
        reps = -(-numel // POOL_SIZE)
        return chunk.repeat(reps)[:numel].view(shape).to(self.dtype)


def tokenizer_vocab(tokenizer_dir: Path) -> int:
    """The tokenizer's vocabulary with its added tokens, rounded up to a multiple of 64."""
    from tokenizers import Tokenizer
    size = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(True)
    return -(-size // 64) * 64


def export_preset(preset: Preset, out_dir: str | Path, tokenizer_from: str | Path,
                  seed: int = 0, dtype: torch.dtype = torch.bfloat16, progress=None) -> Path:
    """Write config.json, one safetensors shard per layer plus one for the embeddings, norm
    and head (with transformers' shard index), and the tokenizer files of `tokenizer_from` (an HF directory) into `out_dir`.
    `progress(layer)` is called after each layer. Returns out_dir.

    Raises:
        ValueError: a preset Mixtral cannot express (`hf_config`).
        FileNotFoundError: `tokenizer_from` has no tokenizer.json.
    """
    from safetensors.torch import save_file
    src, out = Path(tokenizer_from), Path(out_dir)
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {src}")
    config = hf_config(preset, tokenizer_vocab(src))
    out.mkdir(parents=True, exist_ok=True)
    fill = _Filler(seed, dtype)
    n = config["num_hidden_layers"]
    names = [f"model-{i + 1:05d}-of-{n + 1:05d}.safetensors" for i in range(n + 1)]
    weight_map, total = {}, 0
    v, h = config["vocab_size"], config["hidden_size"]
    outer = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
             "lm_head.weight": (v, h)}
    for index, name in enumerate(names):
        shapes = layer_shapes(preset, config, index) if index < n else outer
        tensors = {k: fill(k, s) for k, s in shapes.items()}
        save_file(tensors, str(out / name))
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
        if progress is not None and index < n:
            progress(index)
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out
