"""Multi-head Latent Attention (MLA; DeepSeek-V2, arXiv 2405.04434 sec. 2.1; DeepSeek-V3,
arXiv 2412.19437 sec. 2.1.1): the projections, norms and RoPE of DeepSeek's attention.

Per token, kv_a_proj_with_mqa gives the compressed key/value c_kv (kv_lora_rank values,
RMS-normalised) and one key part k_pe (qk_rope_head_dim values) that every head shares and
that alone carries RoPE; the query is q_proj(x), or q_b_proj(RMSNorm(q_a_proj(x))) with a
query LoRA rank, split per head into a part without RoPE (qk_nope_head_dim) and one with
it (qk_rope_head_dim). The KV cache holds [c_kv | k_pe] per token and layer; attending
through it, in the absorbed form for decode and verification, is `mla_attention`.

Conventions matched to HuggingFace transformers' DeepseekV2/V3 modules:
- RoPE on interleaved pairs (2i, 2i + 1) (V2 always: its complex-number form; V3 unless
  `rope_interleave` is false, then the usual halves). We take the even then the odd
  dimensions of q_pe and k_pe and rotate those halves ("neox" layout), which is the same
  rotation of the same pairs (transformers' `apply_rotary_pos_emb_interleave` returns this
  order too); query and key share the layout, so the scores are unchanged.
- Softmax scale (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times mscale(factor,
  mscale_all_dim)^2 when the RoPE scaling sets mscale_all_dim (`mla_softmax_scale`);
  YaRN's cos/sin attention factor is in the shared `RotaryEmbedding`'s tables.
- q_a_layernorm and kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says (transformers and
  DeepSeek's own code build them with the default).
"""

from __future__ import annotations

import torch
from torch import nn

from specmoe.config import ArchConfig, MLAConfig
from specmoe.layers.linear import Linear
from specmoe.layers.mla_attention import MLACache, mla_paged_attention, write_latent_cache
from specmoe.layers.norm import RMSNorm
from specmoe.layers.paged_attention import AttentionMetadata
from specmoe.layers.rotary import RotaryEmbedding, yarn_mscale

LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(mla: MLAConfig, rope_scaling: dict | None) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times mscale^2 with mscale =
    0.1 * mscale_all_dim * ln(factor) + 1 when rope_scaling (any type but default) sets
    mscale_all_dim (DeepSeek-V2's YaRN temperature; transformers' `yarn_apply_mscale`)."""
    scale = mla.qk_head_dim ** -0.5
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
    if rope_type not in (None, "default") and rope_scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale *= m * m
    return scale


class KVUpProjection(nn.Module):
    """kv_b_proj's weight [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank], per head the
    key rows W_UK_h over the value rows W_UV_h.

    Not a `Linear`: the absorbed attention reads W_UK and W_UV themselves, so the weight
    stays dense in the model dtype (not packed for the bf16 kernel, its dense copy not
    released, not quantised by `quantize_model`).
    """

    def __init__(self, kv_lora_rank: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, kv_lora_rank))


class MLAttention(nn.Module):
    """DeepSeek's Multi-head Latent Attention over a paged latent cache.

    Args:
        config: the architecture; uses hidden_size, num_attention_heads, attention_bias,
            rope_scaling and mla (which must be set).
        rotary: the RoPE module shared by all layers, over qk_rope_head_dim dimensions.

    Attributes:
        absorb: attend decode and verification rows in the absorbed form (True, the
            default) or decompress the latents for every row (False: the reference).

    Raises:
        ValueError: config.mla is None.
    """

    def __init__(self, config: ArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError(f"{config.architecture}: MLAttention needs config.mla")
        h, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads
        self.nope, self.rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        self.rope_interleave = mla.rope_interleave
        q_size = heads * mla.qk_head_dim
        self.q_lora = mla.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = Linear(h, q_size)
        else:
            self.q_a_proj = Linear(h, mla.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_size)
        self.kv_a_proj_with_mqa = Linear(h, mla.latent_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = KVUpProjection(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.o_proj = Linear(heads * mla.v_head_dim, h, bias=config.attention_bias)
        self.rotary = rotary
        self.scale = mla_softmax_scale(mla, config.rope_scaling)
        self.absorb = True

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: MLACache,
                meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden]; positions [T] int64; kv_cache (latent,) [num_slots, kv_lora_rank +
        qk_rope_head_dim], written in place at meta.slot_mapping. Returns [T, hidden]."""
        t = x.shape[0]
        q = self._query(x).view(t, self.num_heads, self.nope + self.rope)
        kv = self.kv_a_proj_with_mqa(x)  # [T, rank + rope]
        c_kv = self.kv_a_layernorm(kv[:, :self.kv_lora_rank])
        q_pe, k_pe = self._rotate(positions, q[..., self.nope:], kv[:, None, self.kv_lora_rank:])
        write_latent_cache(torch.cat([c_kv, k_pe[:, 0].to(c_kv.dtype)], dim=-1), kv_cache, meta)
        out = mla_paged_attention(q[..., :self.nope], q_pe, kv_cache, meta, self.scale,
                                  self.kv_b_proj.weight, self.absorb)  # [T, H, v]
        return self.o_proj(out.reshape(t, -1))

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if not self.q_lora:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _rotate(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of q_pe [T, H, rope] and k_pe [T, 1, rope] (fresh tensors: the bf16 kernel
        rotates in place), in the rotated-halves layout."""
        if self.rope_interleave:
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
        else:
            q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
        return self.rotary(positions, q_pe, k_pe)
