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

# Above this many query tokens a forward is prefill-like and uses fused SDPA.
_MAX_SMALL_QUERY = 16


@dataclass(slots=True)
class AttentionMetadata:
    """Where the tokens of one forward sit in the sequence.

    Attributes:
        start_pos: position of the first token (= tokens already in the KV cache).
        num_tokens: tokens in this forward.
        mask: [num_tokens, start_pos + num_tokens] bool (True = attend), or None when every
            cached position is visible (one token, no sliding window).
        is_plain_causal: the mask is the plain lower-triangular one (a prefill from 0).
    """

    start_pos: int
    num_tokens: int
    mask: torch.Tensor | None = None
    is_plain_causal: bool = True

    @classmethod
    def build(cls, start_pos: int, num_tokens: int, device: torch.device,
              sliding_window: int | None = None) -> "AttentionMetadata":
        """Metadata for tokens [start_pos, start_pos + num_tokens), with the causal (and
        sliding-window) mask built once per forward and shared by all layers."""
        total = start_pos + num_tokens
        mask = None
        if num_tokens > 1 or (sliding_window is not None and total > sliding_window):
            q_pos = torch.arange(start_pos, total, device=device).unsqueeze(1)
            k_pos = torch.arange(total, device=device).unsqueeze(0)
            mask = k_pos <= q_pos  # [num_tokens, total]
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        is_plain_causal = start_pos == 0 and (sliding_window is None or total <= sliding_window)
        return cls(start_pos, num_tokens, mask, is_plain_causal)


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
        if meta.num_tokens > _MAX_SMALL_QUERY:
            out = self._attend_sdpa(q, k_cache[:, :end], v_cache[:, :end], meta)
        else:
            out = self._attend_small(q, k_cache[:, :end], v_cache[:, :end], meta)
        return self.o_proj(out)

    def _attend_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        """Prefill-sized queries: q [T, heads, hd]; k, v [kv_heads, L, hd] -> [T, q_size]."""
        causal = meta.is_plain_causal
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),  # [1, h, T|L, hd]
            attn_mask=None if causal else meta.mask, is_causal=causal, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return out.squeeze(0).transpose(0, 1).reshape(meta.num_tokens, self.q_size)

    def _attend_small(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """Decode and verification (few query tokens): explicit GQA attention, cheaper on
        CPU than SDPA for one query row. q [T, heads, hd]; k, v [kv_heads, L, hd]."""
        t, group = meta.num_tokens, self.num_heads // self.num_kv_heads
        # Query head h = kv_head * group + g; rows of qh are ordered (g, t).
        qh = q.reshape(t, self.num_kv_heads, group, self.head_dim).permute(1, 2, 0, 3)
        qh = qh.reshape(self.num_kv_heads, group * t, self.head_dim)
        scores = torch.bmm(qh, k.transpose(1, 2)).float() * self.scale  # [kv, g*T, L]
        if meta.mask is not None:
            scores.masked_fill_(~meta.mask.repeat(group, 1), float("-inf"))
        probs = scores.softmax(dim=-1).to(v.dtype)
        out = torch.bmm(probs, v)  # [kv_heads, group * T, hd]
        out = out.reshape(self.num_kv_heads, group, t, self.head_dim).permute(2, 0, 1, 3)
        return out.reshape(t, self.q_size)

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
