"""A dense Llama/Qwen2 checkpoint in float32 and its forward in plain torch, layer by layer,
for carving: the carver needs each layer's FFN input and output on calibration text, from
the dense model and from the partly carved one, which the serving model (paged KV cache,
packed weights) does not expose. Checked against transformers in the tests.

Attention follows Llama (Touvron et al. 2023, arXiv 2302.13971) as transformers implements
it: RMSNorm, q/k/v (Qwen2: with bias), rotary embedding in the rotate-half layout, grouped
query attention, causal softmax, o_proj; the FFN is SwiGLU (Shazeer 2020, arXiv 2002.05202).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specmoe.loader.aliases import resolve_model_path
from specmoe.loader.model_loader import load_tokenizer, open_checkpoint
from specmoe.models.common import rope_fields

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@dataclass
class DenseCheckpoint:
    """A dense decoder's HF config and its tensors (HF names, float32 on CPU).

    Attributes:
        path: where it was read (a HuggingFace directory or a GGUF file).
        config: the HF config dict (GGUF metadata turned into one).
        tensors: name -> float32 tensor, e.g. "model.layers.0.mlp.gate_proj.weight".
    """

    path: Path
    config: dict
    tensors: dict[str, torch.Tensor]

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def intermediate_size(self) -> int:
        return int(self.config["intermediate_size"])

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s tensors, keyed by their names inside the layer
        ("self_attn.q_proj.weight", "mlp.down_proj.weight", ...)."""
        prefix = f"model.layers.{index}."
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}

    def lm_head(self) -> torch.Tensor:
        """[V, H]: the output projection (the embedding when tied)."""
        return self.tensors.get("lm_head.weight", self.tensors["model.embed_tokens.weight"])

    def tokenizer(self):
        return load_tokenizer(self.path)


def read_dense_config(source: str) -> tuple[Path, dict]:
    """(path, config dict) of a dense model that can be carved, from its config alone (no
    weight is read): the checks of `load_dense`, made before its load.

    Raises:
        FileNotFoundError: no such model.
        ValueError: another architecture, or rope scaling / sliding windows (not carved).
    """
    path = resolve_model_path(source)
    config, _ = open_checkpoint(path, torch.float32)
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in DENSE_ARCHITECTURES:
        raise ValueError(f"cannot carve {source!r}: architecture {arch!r} is not one of "
                         f"{DENSE_ARCHITECTURES}")
    _, scaling = rope_fields(config)
    if scaling or config.get("use_sliding_window"):
        raise ValueError(f"cannot carve {source!r}: rope scaling {scaling!r} and sliding "
                         "windows are not supported")
    return path, dict(config)


def load_dense(source: str) -> DenseCheckpoint:
    """Read a dense Llama or Qwen2 model (an alias, a HuggingFace directory or a GGUF file,
    dequantised) into float32.

    Raises:
        FileNotFoundError, ValueError: as `read_dense_config`.
    """
    path, config = read_dense_config(source)
    _, tensors = open_checkpoint(path, torch.float32)
    return DenseCheckpoint(path, config, {k: v.float().contiguous() for k, v in tensors})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] * rsqrt(mean(x^2) + eps) * weight, in float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotary(config: dict, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [seq_len, head_dim] of the default rotary embedding (base rope_theta, from
    either config generation)."""
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    inv = 1.0 / (rope_fields(config)[0] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention_block(config: dict, w: dict[str, torch.Tensor], h: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """h + attention(input_norm(h)) for a batch of windows h [B, S, H] (each window causal
    from position 0); returns [B, S, H] float32."""
    b, s, _ = h.shape
    nh, nkv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    hd = int(config.get("head_dim") or config["hidden_size"] // nh)
    x = rms_norm(h, w["input_layernorm.weight"], float(config["rms_norm_eps"]))

    def proj(name: str, heads: int) -> torch.Tensor:
        y = F.linear(x, w[f"self_attn.{name}.weight"], w.get(f"self_attn.{name}.bias"))
        return y.view(b, s, heads, hd).transpose(1, 2)  # [B, heads, S, hd]

    cos, sin = rope[0][:s], rope[1][:s]
    q = _rotate(proj("q_proj", nh), cos, sin)
    k = _rotate(proj("k_proj", nkv), cos, sin)
    v = proj("v_proj", nkv)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nh != nkv)
    return h + F.linear(o.transpose(1, 2).reshape(b, s, nh * hd), w["self_attn.o_proj.weight"])


def ffn_input(config: dict, w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """post_attention_layernorm(h): what the layer's FFN (or MoE) reads."""
    return rms_norm(h, w["post_attention_layernorm.weight"], float(config["rms_norm_eps"]))


def ffn_activations(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T): [..., I], the per-neuron activations."""
    return F.silu(F.linear(x, w["mlp.gate_proj.weight"])) * F.linear(x, w["mlp.up_proj.weight"])


def dense_ffn(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The dense SwiGLU FFN: [..., H] -> [..., H]."""
    return F.linear(ffn_activations(w, x), w["mlp.down_proj.weight"])


def embed(ckpt: DenseCheckpoint, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, S] int64 -> hidden [B, S, H] float32."""
    return F.embedding(ids, ckpt.tensors["model.embed_tokens.weight"])


def logits(ckpt: DenseCheckpoint, h: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head: [B, S, H] -> [B, S, V] float32."""
    x = rms_norm(h, ckpt.tensors["model.norm.weight"], float(ckpt.config["rms_norm_eps"]))
    return F.linear(x, ckpt.lm_head())


def forward(ckpt: DenseCheckpoint, ids: torch.Tensor, ffn=None) -> torch.Tensor:
    """Logits [B, S, V] of windows ids [B, S]; `ffn(layer_index, weights, x)` replaces the
    dense FFN when given (how the carved model's logits are computed)."""
    rope = rotary(ckpt.config, ids.shape[1])
    h = embed(ckpt, ids)
    for index in range(ckpt.num_layers):
        w = ckpt.layer(index)
        h = attention_block(ckpt.config, w, h, rope)
        x = ffn_input(ckpt.config, w, h)
        h = h + (dense_ffn(w, x) if ffn is None else ffn(index, w, x))
    return logits(ckpt, h)
