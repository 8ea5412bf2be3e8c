"""An int8 KV cache with one scale per token and KV head.

Each key and value row ([head_dim] of one token and KV head) is stored as int8 with a float32
scale: scale = max|x| / 127, q = round_half_even(x / scale) clamped to [-127, 127] (a row of
zeros: scale 0, q 0), so the dequantised row is q * scale and each element is within scale / 2
of the original. A row is quantised once, when its token is written, from its own values
alone: the stored bits do not depend on the batch or on which forward wrote them, so greedy
speculation over this cache equals plain decoding over it. This is the per-token symmetric
scheme of KIVI's value cache and of llama.cpp's q8_0 cache with the block widened to the head
(Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
arXiv 2402.02750; our own implementation).

Attention reads it through `specmoe.kernels.attention.try_attention_int8` (float32, AVX2;
the few-query sequences) and otherwise through the plain-torch path of
`specmoe.layers.paged_attention` over the rows dequantised to float32, which is also the
kernel's reference. Keys and values cost head_dim + 4 bytes per token and KV head, against
2 * head_dim in bfloat16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specmoe.kernels.attention import try_attention_int8
from specmoe.layers.paged_attention import (MAX_DECODE_QUERY, AttentionMetadata,
                                            attend_decodes, attend_prefills)

QMAX = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] float -> (int8 [..., head_dim], float32 scales [...]): each row's
    symmetric int8 codes and scale (module docstring). Non-finite inputs give undefined
    codes, as they would give undefined attention."""
    x = x.float()
    scale = x.abs().amax(-1) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / safe[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., head_dim] and scales [...] -> float32 [..., head_dim]."""
    return codes.float() * scale[..., None]


class Int8KV(NamedTuple):
    """One layer's int8 KV cache: key, value int8 [num_slots, num_kv_heads, head_dim] and
    key_scale, value_scale float32 [num_slots, num_kv_heads] (module docstring). Zero-filled
    at creation, so padded reads are finite."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor
    value_scale: torch.Tensor

    @classmethod
    def zeros(cls, num_slots: int, num_kv_heads: int, head_dim: int,
              device: torch.device | str) -> Int8KV:
        codes = (num_slots, num_kv_heads, head_dim)
        return cls(*(torch.zeros(codes, dtype=torch.int8, device=device) for _ in range(2)),
                   *(torch.zeros(codes[:2], dtype=torch.float32, device=device)
                     for _ in range(2)))

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one token's keys and values in one layer (codes and scales)."""
        return 2 * num_kv_heads * (head_dim + 4)

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantise k, v ([num_tokens, num_kv_heads, head_dim]) and store them at slots
        [num_tokens]."""
        for x, codes, scales in ((k, self.key, self.key_scale), (v, self.value,
                                                                  self.value_scale)):
            q, s = quantize_rows(x)
            codes.index_copy_(0, slot_mapping, q)
            scales.index_copy_(0, slot_mapping, s)

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised keys and values at `slots` ([N] int64): two float32 [N, num_kv_heads,
        head_dim]."""
        return (dequantize_rows(self.key.index_select(0, slots),
                                self.key_scale.index_select(0, slots)),
                dequantize_rows(self.value.index_select(0, slots),
                                self.value_scale.index_select(0, slots)))

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """`specmoe.layers.paged_attention.paged_attention` over this cache: q [num_tokens,
        num_heads, head_dim] in any float dtype, computed in float32; returns [num_tokens,
        num_heads * head_dim] in q's dtype."""
        num_tokens, num_heads, head_dim = q.shape
        q32 = q.to(torch.float32, memory_format=torch.contiguous_format)
        out = q32.new_empty(num_tokens, num_heads * head_dim)
        if not try_attention_int8(q32, self, meta.sequences, scale, meta.sliding_window, out,
                                  MAX_DECODE_QUERY):
            attend_decodes(q32, self, meta, scale, out)
        attend_prefills(q32, self, meta, scale, out)
        return out.to(q.dtype)
