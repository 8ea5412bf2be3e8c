"""Paged attention over a Multi-head Latent Attention (MLA) cache, in plain torch.

MLA (DeepSeek-V2, arXiv 2405.04434 sec. 2.1) caches per token and layer one latent row
[c_kv | k_pe] of kv_lora_rank + qk_rope_head_dim values: c_kv, the normalised compressed
key/value, and k_pe, the RoPE'd key part every head shares. Head h's key is
[W_UK_h c_kv | k_pe] and its value W_UV_h c_kv, where kv_b_proj's weight [H * (nope + v),
rank] stacks per head W_UK_h [nope, rank] over W_UV_h [v, rank]. The cache lives in the
paged layout of `paged_attention` (slot = block * block_size + offset, one latent row per
slot) and the same `AttentionMetadata` drives it, so block tables, prefix caching and
rollback are unchanged.

Two ways to attend, equal in exact arithmetic:
- absorbed (`_attend_absorbed`; the paper's sec. 2.1.3 and vLLM/SGLang's MLA decode):
  W_UK_h is folded into the query, q_c = W_UK_h^T q_nope, so scores are
  [q_c | q_pe] . [c_kv | k_pe] against the latent rows themselves (multi-query attention
  with one key/value "head" of width rank + rope), and W_UV_h is applied once to the
  probability-weighted latent. The keys and values of the context are never materialised:
  per key it reads rank + rope values, not H * (nope + rope + v). Used for sequences with
  few query tokens (decode and verification of draft tokens: at most
  `paged_attention.MAX_DECODE_QUERY`).
- decompressed (`_attend_decompressed`): c_kv up-projected to every head's keys and values
  and ordinary softmax attention (SDPA), as transformers does. Used for prefill chunks,
  where the per-head keys cost less than the absorbed queries' width (vLLM's choice too),
  and as the absorbed form's reference (`absorb=False`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specmoe.layers.paged_attention import AttentionMetadata, DecodeGroup

MLACache = tuple[torch.Tensor]


def write_latent_cache(latent: torch.Tensor, kv_cache: MLACache, meta: AttentionMetadata
                       ) -> None:
    """Store the new tokens' latent rows `latent` [num_tokens, rank + rope] at their slots
    (meta.slot_mapping) of the layer's cache (latent_cache,), [num_slots, rank + rope]."""
    cache = kv_cache[0]
    cache.index_copy_(0, meta.slot_mapping, latent.to(cache.dtype))


def mla_paged_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: MLACache,
                        meta: AttentionMetadata, scale: float, kv_b_weight: torch.Tensor,
                        absorb: bool = True) -> torch.Tensor:
    """Attention of every new token over its sequence's cached latents.

    Args:
        q_nope: [num_tokens, H, nope] query parts without RoPE.
        q_pe: [num_tokens, H, rope] query parts with RoPE applied (same layout as the
            cached k_pe).
        kv_cache: (latent_cache,) [num_slots, rank + rope], already holding the new tokens
            (`write_latent_cache`).
        meta: this forward's metadata (sliding windows are honoured, though MLA models
            have none).
        scale: softmax scale (MLA: (nope + rope) ** -0.5, times YaRN's mscale^2).
        kv_b_weight: kv_b_proj's weight [H * (nope + v), rank].
        absorb: attend the few-query sequences in the absorbed form (False: every sequence
            decompressed, the reference).

    Returns:
        [num_tokens, H, v] in q_nope's dtype.
    """
    num_tokens, num_heads, nope = q_nope.shape
    w_kv = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[1])  # [H, nope + v, rank]
    v_dim = w_kv.shape[1] - nope
    latent = kv_cache[0]
    out = q_nope.new_empty(num_tokens, num_heads, v_dim)
    for group in meta.decodes:
        rows = group.token_index
        if absorb:
            out[rows] = _attend_absorbed(q_nope[rows], q_pe[rows], latent, group, scale, w_kv)
        else:
            out[rows] = _attend_decompressed(q_nope[rows], q_pe[rows], latent, group.kv_index,
                                             group.mask, scale, w_kv, group)
    for seq in meta.prefills:
        rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
        out[rows] = _attend_decompressed(q_nope[rows], q_pe[rows], latent, seq.kv_index[None],
                                         None if seq.mask is None else seq.mask[None],
                                         scale, w_kv, None)
    return out


def _padded(x: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    """A group's rows x [rows, ...] at their padded positions [B * max_query, ...] (zeros
    elsewhere)."""
    out = x.new_zeros(group.kv_index.shape[0] * group.max_query, *x.shape[1:])
    out[group.padded_index] = x
    return out


def _attend_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                     group: DecodeGroup, scale: float, w_kv: torch.Tensor) -> torch.Tensor:
    """[rows, H, v] in q_nope's dtype for a decode group's rows (order of
    group.token_index), computed in float32.

    The queries of all heads and query positions of a sequence are the rows of one matmul
    against its gathered latent rows (one shared key/value "head"), masked per position.
    """
    rows, num_heads, nope = q_nope.shape
    rank = w_kv.shape[2]
    batch, length = group.kv_index.shape
    w_uk, w_uv = w_kv[:, :nope].float(), w_kv[:, nope:].float()  # [H, nope|v, rank]
    q_c = torch.einsum("thn,hnr->thr", q_nope.float(), w_uk)  # [rows, H, rank]
    q_lat = _padded(torch.cat([q_c, q_pe.float()], dim=-1), group)  # [B * t, H, rank + rope]
    q_lat = q_lat.view(batch, group.max_query * num_heads, -1)
    kv = latent.index_select(0, group.kv_index.view(-1)).view(batch, length, -1).float()
    scores = torch.matmul(q_lat, kv.transpose(1, 2)).mul_(scale)  # [B, t * H, L]
    scores = scores.view(batch, group.max_query, num_heads, length)
    scores.masked_fill_(~group.mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, group.max_query * num_heads, length)
    o_lat = torch.matmul(probs, kv[..., :rank])  # [B, t * H, rank]
    o_lat = o_lat.view(batch * group.max_query, num_heads, rank)[group.padded_index]
    return torch.einsum("thr,hvr->thv", o_lat, w_uv).to(q_nope.dtype)  # [rows, H, v]


def _attend_decompressed(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                         kv_index: torch.Tensor, mask: torch.Tensor | None, scale: float,
                         w_kv: torch.Tensor, group: DecodeGroup | None) -> torch.Tensor:
    """[rows, H, v] by SDPA over per-head keys/values decompressed from the latent rows.

    kv_index: [B, L] cache slots of each sequence's positions; mask: [B, t, L] bool (True:
    attend) or None for a causal prefill from position 0 (then B = 1); group: for decode
    groups, how the rows pad into [B, t] (None: B = 1 and the rows are the t queries).
    """
    rows, num_heads, nope = q_nope.shape
    rank = w_kv.shape[2]
    batch, length = kv_index.shape
    kv = latent.index_select(0, kv_index.view(-1)).view(batch, length, -1)
    c_kv, k_pe = kv[..., :rank], kv[..., rank:]
    kv_heads = F.linear(c_kv, w_kv.reshape(-1, rank).to(kv.dtype))
    kv_heads = kv_heads.view(batch, length, num_heads, -1)  # [B, L, H, nope + v]
    k_nope, v = kv_heads[..., :nope], kv_heads[..., nope:]
    k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, num_heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)  # [rows, H, nope + rope]
    q = (_padded(q, group) if group is not None else q).view(batch, -1, num_heads, q.shape[-1])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=None if mask is None else mask[:, None], is_causal=mask is None,
        scale=scale)  # [B, H, t, v]
    out = out.transpose(1, 2).reshape(-1, num_heads, v.shape[-1])  # [B * t, H, v]
    return out[group.padded_index] if group is not None else out
