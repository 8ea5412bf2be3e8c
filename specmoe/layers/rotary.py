"""Rotary position embedding (RoPE; Su et al. 2021, arXiv 2104.09864), "neox" half-rotation
layout as in HuggingFace Llama, with linear and Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from specmoe.kernels.elementwise import try_rotary_bf16

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32 for RoPE, after scaling.

    Raises:
        ValueError: for a rope_type other than default, linear, llama3.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling).float()
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


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys at given absolute positions.

    Args:
        head_dim: rotated dimension (the whole head).
        max_position: size of the precomputed cos/sin table, in tokens.
        theta: RoPE base frequency.
        scaling: HuggingFace rope_scaling dict or None.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

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
