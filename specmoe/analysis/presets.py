"""Synthetic-weight model presets of realistic shape for measuring verification cost.

No MoE weights are available offline, and the time of a forward does not depend on the
weight values, so the study builds models of real MoE shapes with random weights. The MoE
presets hold the same routed-expert weights per MoE layer (N * expert width = EXPERT_WIDTH)
in as many MoE layers, and differ in sparsity: N=128/k=8 (Qwen3-MoE-like fine-grained
experts), N=64/k=8 (OLMoE-like), N=8/k=2 (Mixtral-like) and N=256/k=8 (DeepSeek-V3-like:
k/N = 3.1%). The first three share Llama-style attention and differ only in sparsity; the
DeepSeek one is built as DeepSeek-V3 is: Multi-head Latent Attention, grouped sigmoid
routing, one shared expert and a dense first layer ahead of its MoE layers. Two dense presets
bracket them: one with the N=128 MoE's active parameters per token, one with its total
parameters. A small dense draft model gives the draft cost of the speedup synthesis.

Shapes are scaled to fit a 24 GiB, 2-core machine; `scale_layers` multiplies the depth for
bigger hardware. `check_preset_sizes` enforces the issue's rule that every preset's weights are
at least 4x the last-level cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specmoe.config import ArchConfig, MLAConfig, MoEConfig
from specmoe.layers.moe.experts import WIDTH_MULTIPLE

HIDDEN = 2048
NUM_LAYERS = 6
VOCAB = 32768
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 4, 128
# Total routed-expert width per MoE layer, N * moe_intermediate_size, equal for every MoE preset.
EXPERT_WIDTH = 128 * 384

# DeepSeek-V3's attention at HIDDEN. Every DeepSeek release, V2-Lite (H=2048) through V3
# (H=7168), keeps the per-head widths (128 without RoPE, 64 with, 128 per value) and the
# latent (kv_lora_rank 512) and scales only the head count with H: at H=2048 that is 16
# heads of 128, as many as the other presets have, and exactly V2-Lite's attention. V3's
# query LoRA rank, 1536 = 3/14 of its H, would be 439 here: rounded up to 512, the latent's
# width. 10.1 M weights per layer against the grouped-query presets' 10.5 M; the cache holds
# 576 values per token and layer against their 1024.
DEEPSEEK_MLA = MLAConfig(q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128)
# DeepSeek-V3's routing: sigmoid scores, 8 groups of which each token keeps 4 (node-limited
# routing), weights renormalised and scaled by 2.5.
DEEPSEEK_GROUPS, DEEPSEEK_TOPK_GROUPS, DEEPSEEK_ROUTED_SCALING = 8, 4, 2.5


@dataclass(frozen=True)
class Preset:
    """A synthetic model shape.

    Attributes:
        name: preset id used on the command line and in reports.
        description: what it stands for, in words.
        num_experts: N (0: dense).
        top_k: k (0: dense).
        intermediate_size: MLP width of a dense preset, or one routed expert's width.
        num_layers: decoder layers (the dense first layers of an MoE preset included).
        hidden_size: H.
        role: "target" or "draft".
        shared_experts: always-on experts of the routed width in every MoE layer (DeepSeek's
            n_shared_experts; one SwiGLU of shared_experts * intermediate_size, no gate).
        first_dense_layers: leading layers of an MoE preset with a dense SwiGLU MLP instead
            of the MoE block (DeepSeek's first_k_dense_replace), of width `dense_width`.
        mla: Multi-head Latent Attention dims; set, the preset is DeepSeek-V3-shaped (its
            architecture "DeepseekV3ForCausalLM": MLA, sigmoid routing over `n_group`
            groups keeping `topk_group`, routed weights scaled by DEEPSEEK_ROUTED_SCALING).
            None: Llama-style grouped-query attention, softmax top-k routing. A dict (as
            `dataclasses.asdict` writes it into results.json) is read back as an MLAConfig.
        n_group, topk_group: expert groups and groups kept per token (1, 1: ungrouped).

    Raises:
        ValueError: DeepSeek options on a dense preset, groups without `mla`, or no MoE
            layer left after the dense first layers.
    """

    name: str
    description: str
    num_experts: int
    top_k: int
    intermediate_size: int
    num_layers: int = NUM_LAYERS
    hidden_size: int = HIDDEN
    role: str = "target"
    shared_experts: int = 0
    first_dense_layers: int = 0
    mla: MLAConfig | None = None
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MLAConfig(**self.mla))
        if not self.is_moe and (self.shared_experts or self.first_dense_layers):
            raise ValueError(f"preset {self.name}: shared experts and dense first layers are "
                             "options of an MoE preset")
        if self.is_moe and not 0 <= self.first_dense_layers < self.num_layers:
            raise ValueError(f"preset {self.name}: first_dense_layers="
                             f"{self.first_dense_layers} leaves no MoE layer of "
                             f"{self.num_layers}")
        if (self.n_group, self.topk_group) != (1, 1) and self.mla is None:
            raise ValueError(f"preset {self.name}: grouped routing is DeepSeek's, set mla")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        """Layers with an MoE block (0 for dense)."""
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def dense_width(self) -> int:
        """Width of a dense layer's MLP: intermediate_size for a dense preset; for an MoE
        preset's dense first layers (top_k + shared_experts) experts' worth, the work an MoE
        layer does per token (DeepSeek-V3: 18432 = (8 + 1) x 2048)."""
        if not self.is_moe:
            return self.intermediate_size
        return (self.top_k + self.shared_experts) * self.intermediate_size

    def arch(self) -> ArchConfig:
        """The ArchConfig of this preset in the engine's `DecoderModel`, bf16: Llama-style
        attention and SwiGLU MLP or experts ("SyntheticMoE", "SyntheticDense"), or with
        `mla` DeepSeek-V3's layout ("DeepseekV3ForCausalLM", as `models.deepseek` parses a
        V3 config.json)."""
        heads, kv_heads = self._heads()
        mla = self.mla
        if mla is not None:
            architecture, kv_heads, head_dim = "DeepseekV3ForCausalLM", heads, mla.qk_rope_head_dim
        else:
            architecture = "SyntheticMoE" if self.is_moe else "SyntheticDense"
            head_dim = HEAD_DIM
        return ArchConfig(
            architecture=architecture, vocab_size=VOCAB, hidden_size=self.hidden_size,
            intermediate_size=self.dense_width if self.num_moe_layers < self.num_layers else 0,
            num_hidden_layers=self.num_layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
            rope_theta=1e6, max_position_embeddings=4096,
            moe=self._moe() if self.is_moe else None, mla=mla)

    def _moe(self) -> MoEConfig:
        deepseek = {} if self.mla is None else dict(
            scoring_func="sigmoid", topk_method="noaux_tc", n_group=self.n_group,
            topk_group=self.topk_group, routed_scaling_factor=DEEPSEEK_ROUTED_SCALING)
        return MoEConfig(num_experts=self.num_experts, top_k=self.top_k,
                         moe_intermediate_size=self.intermediate_size, norm_topk_prob=True,
                         shared_expert_intermediate_size=self.shared_experts
                         * self.intermediate_size,
                         moe_layers=list(range(self.first_dense_layers, self.num_layers)),
                         **deepseek)

    def _heads(self) -> tuple[int, int]:
        heads = max(1, self.hidden_size // HEAD_DIM)
        return heads, max(1, heads // (NUM_HEADS // NUM_KV_HEADS))

    def scaled(self, scale_layers: float) -> "Preset":
        """The same preset with round(layers * scale_layers) layers (at least 1), counting
        the MoE layers of an MoE preset; its dense first layers stay as they are."""
        fixed = self.first_dense_layers
        layers = fixed + max(1, round((self.num_layers - fixed) * scale_layers))
        return dataclasses.replace(self, num_layers=layers)


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("moe-128x8", "MoE, N=128 experts, top-8 (Qwen3-MoE-like)", 128, 8, EXPERT_WIDTH // 128),
    Preset("moe-64x8", "MoE, N=64 experts, top-8 (OLMoE-like)", 64, 8, EXPERT_WIDTH // 64),
    Preset("moe-8x2", "MoE, N=8 experts, top-2 (Mixtral-like)", 8, 2, EXPERT_WIDTH // 8),
    # deepseek-256x8's sparsity alone (its attention, routing and layers as the others'):
    # separates what k/N = 3.1% does to verification from what MLA and the shared expert do
    Preset("moe-256x8", "MoE, N=256 experts, top-8 (deepseek-256x8's sparsity, plain "
           "attention)", 256, 8, EXPERT_WIDTH // 256),
    # As many MoE layers and routed-expert weights as the others, plus V3's dense first layer
    # (so one layer more, and its weights at least theirs: the cache rule holds as well).
    Preset("deepseek-256x8", "MoE, N=256 experts, top-8, 1 shared expert, MLA, dense first "
           "layer (DeepSeek-V3-like)", 256, 8, EXPERT_WIDTH // 256, NUM_LAYERS + 1,
           shared_experts=1, first_dense_layers=1, mla=DEEPSEEK_MLA, n_group=DEEPSEEK_GROUPS,
           topk_group=DEEPSEEK_TOPK_GROUPS),
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
    """Counts parameters from the shape (no model is built), as `DecoderModel` stores them:
    per layer the attention (projections, the layer's two norms, MLA's latent norms), then a
    dense MLP, or an MoE block (router and its DeepSeek correction bias, N routed experts at
    their stored width, shared experts); the embedding, final norm and LM head."""
    a = preset.arch()
    h = a.hidden_size
    attn = a.attention_params + 2 * h
    if a.mla is not None:
        attn += (a.mla.q_lora_rank or 0) + a.mla.kv_lora_rank
    dense = a.gated_mlp_params(preset.dense_width)
    expert = moe_total = moe_active = 0
    if preset.is_moe:
        stored = -(-preset.intermediate_size // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        expert = a.gated_mlp_params(stored)
        router = h * preset.num_experts
        if a.moe.topk_method == "noaux_tc":
            router += preset.num_experts  # e_score_correction_bias
        always = router + a.gated_mlp_params(a.moe.shared_expert_intermediate_size)
        moe_total = preset.num_experts * expert + always
        moe_active = preset.top_k * expert + always
    n_moe = preset.num_moe_layers
    n_dense = a.num_hidden_layers - n_moe
    head = a.vocab_size * h + h
    common = a.num_hidden_layers * attn + n_dense * dense + head
    total = common + n_moe * moe_total + a.vocab_size * h
    active = common + n_moe * moe_active
    weights = total - a.vocab_size * h
    return PresetSize(total, active, weights * dtype_bytes, active * dtype_bytes,
                      expert * dtype_bytes)


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
