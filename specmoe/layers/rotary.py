"""Rotary position embedding (RoPE; Su et al. 2021, arXiv 2104.09864), "neox" half-rotation
layout as in HuggingFace Llama, with linear, Llama-3 and YaRN (Peng et al. 2023, arXiv
2309.00071) frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from specmoe.kernels.elementwise import try_rotary_bf16

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 for RoPE, after scaling.

    Raises:
        ValueError: for a rope_type other than default, linear, llama3, yarn, or a yarn
            dict without factor or original_max_position_embeddings.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling).float()
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}: supported are "
                     f"{SUPPORTED_ROPE_TYPES}")


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1 frequency-dependent scaling (Meta's reference implementation).
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def _yarn_field(s: dict, name: str):
    if s.get(name) is None:
        raise ValueError(f"rope_scaling of type yarn lacks {name}: {s!r}")
    return s[name]


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, s: dict) -> torch.Tensor:
    # YaRN's "NTK-by-parts": interpolate (divide by factor) the low frequencies, keep the
    # high ones, blend linearly between the dimensions whose wavelengths make beta_slow and
    # beta_fast turns over the original context. float32, in transformers' order of
    # operations (`_compute_yarn_parameters`), so the angles agree to the last bits.
    factor = float(_yarn_field(s, "factor"))
    old_len = _yarn_field(s, "original_max_position_embeddings")
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (unscaled), 0: interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN multiplies cos and sin by (1 for the other types): `attention_factor`
    if given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set
    (DeepSeek's convention), else mscale(factor)."""
    if _rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(_yarn_field(scaling, "factor"))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys at given absolute positions.

    Args:
        head_dim: rotated dimension (the whole head).
        max_position: size of the precomputed cos/sin table, in tokens.
        theta: RoPE base frequency.
        scaling: HuggingFace rope_scaling dict or None (YaRN's attention factor is folded
            into the cos/sin tables, as transformers does).
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64; q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim].
        Returns rotated (q, k) in their input dtype. bf16 on CPU is rotated in place by the
        native kernel (`specmoe.kernels.elementwise`); this code is its reference."""
        if try_rotary_bf16(positions, q, k, self.cos, self.sin):
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, head_dim // 2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
