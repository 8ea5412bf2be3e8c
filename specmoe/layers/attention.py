"""Causal self-attention with grouped-query heads, RoPE and a KV cache.

The cache of one sequence is contiguous: per layer a key and a value tensor of shape
[num_kv_heads, capacity, head_dim]. A forward over tokens at positions
[start_pos, start_pos + num_tokens) writes their keys/values there and attends over
[0, start_pos + num_tokens). Rolling back rejected draft positions is free: the next forward
simply starts at the rolled-back position and overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.config import ArchConfig
from specmoe.layers.linear import Linear
from specmoe.layers.norm import RMSNorm
from specmoe.layers.rotary import RotaryEmbedding


@dataclass(slots=True)
class AttentionMetadata:
    """Where the tokens of one forward sit in the sequence.

    Attributes:
        start_pos: position of the first token (= tokens already in the KV cache).
        num_tokens: tokens in this forward.
        mask: [num_tokens, start_pos + num_tokens] bool (True = attend), or None when a plain
            causal mask (prefill from 0) or no mask (one token) is enough.
    """

    start_pos: int
    num_tokens: int
    mask: torch.Tensor | None = None

    @classmethod
    def build(cls, start_pos: int, num_tokens: int, device: torch.device,
              sliding_window: int | None = None) -> "AttentionMetadata":
        """Metadata for tokens [start_pos, start_pos + num_tokens), with the causal (and
        sliding-window) mask built once per forward and shared by all layers."""
        total = start_pos + num_tokens
        needs_mask = num_tokens > 1 and start_pos > 0
        if sliding_window is not None and total > sliding_window:
            needs_mask = True
        mask = None
        if needs_mask:
            q_pos = torch.arange(start_pos, total, device=device).unsqueeze(1)
            k_pos = torch.arange(total, device=device).unsqueeze(0)
            mask = k_pos <= q_pos  # [num_tokens, total]
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        return cls(start_pos, num_tokens, mask)


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
        """x [T, hidden]; positions [T]; kv_cache (k, v) each [num_kv_heads, capacity,
        head_dim] updated in place. Returns [T, hidden]."""
        q, k, v = self._project(x)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        end = meta.start_pos + meta.num_tokens
        k_cache[:, meta.start_pos:end] = k.transpose(0, 1)
        v_cache[:, meta.start_pos:end] = v.transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),                # [1, heads, T, hd]
            k_cache[:, :end].unsqueeze(0),                 # [1, kv_heads, end, hd]
            v_cache[:, :end].unsqueeze(0),
            attn_mask=meta.mask,
            is_causal=meta.mask is None and meta.num_tokens > 1,
            scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.squeeze(0).transpose(0, 1).reshape(meta.num_tokens, self.q_size)
        return self.o_proj(out)

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
