"""Synthetic-weight model presets of realistic shape for measuring verification cost.

No MoE weights are available offline, and the time of a forward does not depend on the
weight values, so the study builds models of real MoE shapes with random weights. All three
MoE presets hold the same total parameters (same hidden size, layers and attention) and differ
only in sparsity: N=128/k=8 (Qwen3-MoE-like fine-grained experts), N=64/k=8 (OLMoE-like) and
N=8/k=2 (Mixtral-like). Two dense presets bracket them: one with the N=128 MoE's active
parameters per token, one with its total parameters. A small dense draft model gives the
draft cost of the speedup synthesis.

Shapes are scaled to fit a 24 GiB, 2-core machine; `scale_layers` multiplies the depth for
bigger hardware. `check_preset_sizes` enforces the issue's rule that every preset's weights are
at least 4x the last-level cache.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specmoe.config import ArchConfig, MoEConfig

HIDDEN = 2048
NUM_LAYERS = 6
VOCAB = 32768
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 4, 128
# Total routed-expert width per MoE layer, N * moe_intermediate_size, equal for every MoE preset.
EXPERT_WIDTH = 128 * 384


@dataclass(frozen=True)
class Preset:
    """A synthetic model shape.

    Attributes:
        name: preset id used on the command line and in reports.
        description: what it stands for, in words.
        num_experts: N (0: dense).
        top_k: k (0: dense).
        intermediate_size: MLP width of a dense preset, or one routed expert's width.
        num_layers: decoder layers.
        hidden_size: H.
        role: "target" or "draft".
    """

    name: str
    description: str
    num_experts: int
    top_k: int
    intermediate_size: int
    num_layers: int = NUM_LAYERS
    hidden_size: int = HIDDEN
    role: str = "target"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def arch(self) -> ArchConfig:
        """The ArchConfig of this preset (Llama-style attention, SwiGLU experts, bf16)."""
        moe = None
        if self.is_moe:
            moe = MoEConfig(num_experts=self.num_experts, top_k=self.top_k,
                            moe_intermediate_size=self.intermediate_size,
                            norm_topk_prob=True, moe_layers=list(range(self.num_layers)))
        return ArchConfig(
            architecture="SyntheticMoE" if self.is_moe else "SyntheticDense",
            vocab_size=VOCAB, hidden_size=self.hidden_size,
            intermediate_size=0 if self.is_moe else self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self._heads()[0],
            num_key_value_heads=self._heads()[1], head_dim=HEAD_DIM, rms_norm_eps=1e-6,
            rope_theta=1e6, max_position_embeddings=4096, moe=moe)

    def _heads(self) -> tuple[int, int]:
        heads = max(1, self.hidden_size // HEAD_DIM)
        return heads, max(1, heads // (NUM_HEADS // NUM_KV_HEADS))

    def scaled(self, scale_layers: float) -> "Preset":
        """The same preset with round(num_layers * scale_layers) layers (at least 1)."""
        layers = max(1, round(self.num_layers * scale_layers))
        return Preset(self.name, self.description, self.num_experts, self.top_k,
                      self.intermediate_size, layers, self.hidden_size, self.role)


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("moe-128x8", "MoE, N=128 experts, top-8 (Qwen3-MoE-like)", 128, 8, EXPERT_WIDTH // 128),
    Preset("moe-64x8", "MoE, N=64 experts, top-8 (OLMoE-like)", 64, 8, EXPERT_WIDTH // 64),
    Preset("moe-8x2", "MoE, N=8 experts, top-2 (Mixtral-like)", 8, 2, EXPERT_WIDTH // 8),
    Preset("dense-active", "dense, the active parameters of moe-128x8", 0, 0,
           8 * (EXPERT_WIDTH // 128)),
    Preset("dense-total", "dense, the total parameters of moe-128x8", 0, 0, EXPERT_WIDTH),
    Preset("draft", "dense draft model (about 1/5 of moe-128x8's active bytes)", 0, 0, 2048,
           num_layers=4, hidden_size=768, role="draft"),
]}
TARGET_PRESETS = [name for name, p in PRESETS.items() if p.role == "target"]


@dataclass(frozen=True)
class PresetSize:
    """Parameter counts and bytes of a preset in a dtype.

    Attributes:
        total_params: every parameter (embedding table included).
        active_params: parameters one token's forward reads (embedding row excluded; k of N
            experts per MoE layer).
        weight_bytes: bytes of all weights but the embedding table (what a forward that
            touches every expert reads).
        active_bytes: bytes one token's forward reads.
        expert_bytes: bytes of one routed expert (0 for dense).
    """

    total_params: int
    active_params: int
    weight_bytes: int
    active_bytes: int
    expert_bytes: int


def preset_size(preset: Preset, dtype_bytes: int = 2) -> PresetSize:
    """Counts parameters from the shape (no model is built)."""
    a = preset.arch()
    h = a.hidden_size
    attn = a.attention_params + 2 * h  # and the layer's two norms
    expert = a.gated_mlp_params(preset.intermediate_size)
    if preset.is_moe:
        mlp_total = preset.num_experts * (expert) + h * preset.num_experts
        mlp_active = preset.top_k * expert + h * preset.num_experts
    else:
        mlp_total = mlp_active = expert
    head = a.vocab_size * h + h
    total = a.num_hidden_layers * (attn + mlp_total) + head + a.vocab_size * h
    active = a.num_hidden_layers * (attn + mlp_active) + head
    weights = total - a.vocab_size * h
    return PresetSize(total, active, weights * dtype_bytes, active * dtype_bytes,
                      expert * dtype_bytes if preset.is_moe else 0)


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache size the OS reports (sysfs), in bytes, or None if unknown."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        with contextlib.suppress(ValueError):
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes) if sizes else None


def check_preset_sizes(presets: list[Preset], llc_bytes: int | None, dtype_bytes: int,
                       min_ratio: float = 4.0) -> list[str]:
    """Warnings (empty when all is well) for target presets whose weights are under
    `min_ratio` x the last-level cache (their timing would measure cache, not memory)."""
    if not llc_bytes:
        return ["last-level cache size unknown: preset sizes not checked"]
    out = []
    for p in presets:
        size = preset_size(p, dtype_bytes).weight_bytes
        if p.role == "target" and size < min_ratio * llc_bytes:
            out.append(f"preset {p.name}: {size / 2**20:.0f} MiB of weights is under "
                       f"{min_ratio:g}x the {llc_bytes / 2**20:.0f} MiB last-level cache")
    return out


def fill_synthetic_(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place with N(0, 1/fan_in) values (norm weights with ones).

    Values are tiled from a 1M-element random pool, so filling billions of parameters takes
    seconds; timing does not depend on the values, but they are finite and of realistic scale.
    """
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(1 << 20, generator=gen)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
                continue
            flat = p.view(-1)
            scale = 1.0 / math.sqrt(p.shape[-1])
            offset = int(torch.randint(0, pool.numel(), (1,), generator=gen))
            chunk = torch.roll(pool, offset).to(p.dtype) * scale
            for start in range(0, flat.numel(), chunk.numel()):
                n = min(chunk.numel(), flat.numel() - start)
                flat[start:start + n] = chunk[:n]
