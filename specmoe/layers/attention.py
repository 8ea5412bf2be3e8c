"""Causal self-attention with grouped-query heads, RoPE and a paged KV cache.

The projections, norms and RoPE live here; storing keys/values in KV cache blocks and
attending through block tables is `paged_attention`.
"""

from __future__ import annotations

import torch
from torch import nn

from specmoe.config import ArchConfig
from specmoe.layers.linear import Linear
from specmoe.layers.norm import RMSNorm
from specmoe.layers.paged_attention import AttentionMetadata, paged_attention, write_kv_cache
from specmoe.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Multi-head attention with GQA, optional QKV bias, q/k RMSNorm and clipping.

    Args:
        config: the architecture; uses hidden_size, num_attention_heads,
            num_key_value_heads, head_dim, attention_bias, qk_norm, clip_qkv.
        rotary: the RoPE module, shared by all layers.
    """

    def __init__(self, config: ArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd = config.head_dim
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.qkv_proj = Linear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                               bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.qk_norm = config.qk_norm
        if config.qk_norm != "none":
            width = hd if config.qk_norm == "per_head" else None
            self.q_norm = RMSNorm(width or self.q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(width or self.kv_size, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv
        self.rotary = rotary
        self.scale = hd ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        """x [T, hidden]; positions [T]; kv_cache (k, v) each [num_slots, num_kv_heads,
        head_dim], written in place at meta.slot_mapping. Returns [T, hidden]."""
        q, k, v = self._project(x)
        q, k = self.rotary(positions, q, k)
        write_kv_cache(k, v, kv_cache, meta)
        return self.o_proj(paged_attention(q, kv_cache, meta, self.scale))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":  # OLMoE: norm over the whole projection, then clip
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        t = x.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v
