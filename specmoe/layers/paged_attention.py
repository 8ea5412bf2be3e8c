"""Paged attention in plain torch: keys and values live in fixed-size KV cache blocks.

The cache of one layer is a key and a value tensor of shape [num_blocks * block_size,
num_kv_heads, head_dim] (a flat view of [num_blocks, block_size, ...]); token position p of a
sequence lives in slot `block_ids[p // block_size] * block_size + p % block_size` of its block
table. A batched forward concatenates the new tokens of every sequence ([num_tokens, ...]);
sequence i computes positions [start_pos_i, start_pos_i + num_tokens_i) and attends over
[0, start_pos_i + num_tokens_i) of its own blocks (causal, optionally a sliding window).

On CPU in bfloat16 the native kernel (`specmoe.kernels.attention`) attends every
sequence of the forward, decode, verification and prefill rows alike, reading keys and
values once through the block tables. Elsewhere (another device or dtype, kernels switched
off) the plain-torch path splits the sequences, built the first time a layer needs it:
- few query tokens (decode, verification of K drafts: at most `MAX_DECODE_QUERY` tokens):
  gathered into padded batches [num_seqs, max_query, ...] of similar context length (so
  padding at most doubles the keys/values read), attended by float32 matmuls with the query
  heads of each key/value head stacked (`attend_decode_reference` is the SDPA form);
- many query tokens (a prefill chunk): one fused SDPA call per sequence.
The plain-torch path is the kernel's reference in the tests.

A layer's cache is an object with `write` and `attend` (`FloatKV` here; the int8 cache is
`specmoe.layers.int8_kv.Int8KV`); the torch path reads either through its `rows`.

The same code serves one sequence alone, so batch size 1 is not a separate path. Source: the
paged KV cache of Kwon et al., 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", arXiv 2309.06180 (our own plain-torch implementation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specmoe.kernels.attention import try_attention_bf16, try_attention_f32

# Sequences with at most this many query tokens are attended in the padded decode batch.
MAX_DECODE_QUERY = 16
# A decode batch pads every sequence to its longest context; a sequence shorter than this
# fraction of the batch's longest starts another batch, so padding at most doubles the keys
# and values gathered.
MIN_DECODE_FILL = 0.5


@dataclass(slots=True)
class SequenceSlice:
    """One sequence of a batched forward, as the caller schedules it.

    Attributes:
        start_pos: position of its first new token (= tokens already in its KV cache).
        num_tokens: new tokens in this forward (>= 1).
        block_ids: its block table; must cover positions [0, start_pos + num_tokens).
    """

    start_pos: int
    num_tokens: int
    block_ids: list[int]


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with few query tokens, attended as one padded batch of B sequences.

    Attributes:
        token_index: [num_rows] int64: row of the flattened batch for each valid query row.
        padded_index: [num_rows] int64: its row b * max_query + t in the padded batch.
        kv_index: [B, max_len] int64 cache slots of positions 0..max_len-1 (padding: slot 0).
        mask: [B, max_query, max_len] bool, True = attend.
        max_query: padded query length.
    """

    token_index: torch.Tensor
    padded_index: torch.Tensor
    kv_index: torch.Tensor
    mask: torch.Tensor
    max_query: int


@dataclass(slots=True)
class KernelSequences:
    """The sequences of a forward as the native attention kernel reads them
    (`specmoe.kernels.attention`): int64 CPU tensors, contiguous.

    Attributes:
        row_start: [S] first row of each sequence in the flattened batch.
        num_rows: [S] its query rows.
        start_pos: [S] position of its first query row.
        block_tables: [S, max_blocks] its block table (padded with block 0).
        block_size: positions per KV cache block.
    """

    row_start: torch.Tensor
    num_rows: torch.Tensor
    start_pos: torch.Tensor
    block_tables: torch.Tensor
    block_size: int


@dataclass(slots=True)
class PrefillSequence:
    """One sequence with many query tokens.

    Attributes:
        token_start: its first row in the flattened batch.
        num_tokens: its query rows.
        kv_index: [start_pos + num_tokens] int64 cache slots of its positions.
        mask: [num_tokens, start_pos + num_tokens] bool, or None for a plain causal prefill
            from position 0 (fused causal SDPA).
    """

    token_start: int
    num_tokens: int
    kv_index: torch.Tensor
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers of one forward share (built once per forward).

    Attributes:
        num_tokens: rows of the flattened batch.
        slot_mapping: [num_tokens] int64 cache slot each new token's key/value is written to.
        sequences: every sequence, for the native kernel.
        sliding_window: attention window in tokens, or None.
    """

    num_tokens: int
    slot_mapping: torch.Tensor
    sequences: KernelSequences
    sliding_window: int | None
    _slices: list[SequenceSlice]
    _device: torch.device | str
    _decodes: list[DecodeGroup] | None = None  # the plain-torch path's, built on first use
    _prefills: list[PrefillSequence] | None = None

    @classmethod
    def build(cls, seqs: list[SequenceSlice], block_size: int, device: torch.device | str,
              sliding_window: int | None = None) -> AttentionMetadata:
        """Metadata for `seqs`, whose new tokens are concatenated in this order.

        Raises:
            ValueError: no sequences, a sequence with no tokens, or a block table too short
                for its positions.
        """
        if not seqs:
            raise ValueError("a forward needs at least one sequence")
        for i, s in enumerate(seqs):
            if s.num_tokens < 1 or s.start_pos < 0:
                raise ValueError(f"sequence {i}: invalid num_tokens={s.num_tokens} / "
                                 f"start_pos={s.start_pos}")
            if len(s.block_ids) * block_size < s.start_pos + s.num_tokens:
                raise ValueError(f"sequence {i}: {len(s.block_ids)} blocks of {block_size} "
                                 f"cannot hold {s.start_pos + s.num_tokens} positions")
        starts = torch.tensor([s.start_pos for s in seqs], dtype=torch.int64)  # [B]
        counts = torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64)  # [B]
        tables = _block_tables(seqs)  # [B, max_blocks]
        slot_mapping = _slot_mapping(starts, counts, tables, block_size)
        token_starts = torch.cumsum(counts, 0) - counts  # [B]
        sequences = KernelSequences(token_starts, counts, starts, tables, block_size)
        return cls(int(counts.sum()), slot_mapping.to(device), sequences, sliding_window,
                   seqs, device)

    @property
    def decodes(self) -> list[DecodeGroup]:
        """The plain-torch path's padded batches of few-query sequences."""
        if self._decodes is None:
            seqs, k = self._slices, self.sequences
            small = [i for i, s in enumerate(seqs) if s.num_tokens <= MAX_DECODE_QUERY]
            self._decodes = [
                _decode_group(torch.tensor(group), k.start_pos, k.num_rows, k.row_start,
                              k.block_tables, k.block_size, self.sliding_window, self._device)
                for group in _length_groups(small, seqs)]
        return self._decodes

    @property
    def prefills(self) -> list[PrefillSequence]:
        """The plain-torch path's many-query sequences."""
        if self._prefills is None:
            seqs, k = self._slices, self.sequences
            self._prefills = [
                _prefill_sequence(s, int(k.row_start[i]), k.block_tables[i], k.block_size,
                                  self.sliding_window, self._device)
                for i, s in enumerate(seqs) if s.num_tokens > MAX_DECODE_QUERY]
        return self._prefills


def _length_groups(indices: list[int], seqs: list[SequenceSlice]) -> list[list[int]]:
    """`indices` split into groups of similar context length (longest first): a sequence
    joins the current group while its length is >= MIN_DECODE_FILL x the group's longest."""
    groups: list[list[int]] = []
    longest = 0
    for i in sorted(indices, key=lambda i: -(seqs[i].start_pos + seqs[i].num_tokens)):
        length = seqs[i].start_pos + seqs[i].num_tokens
        if not groups or length < MIN_DECODE_FILL * longest:
            groups.append([])
            longest = length
        groups[-1].append(i)
    return groups


def _block_tables(seqs: list[SequenceSlice]) -> torch.Tensor:
    """[B, max_blocks] int64 block tables, padded with block 0."""
    width = max(len(s.block_ids) for s in seqs)
    return torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs],
                        dtype=torch.int64)


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` ([B, n] int64) through `tables` ([B, max_blocks])."""
    blocks = tables.gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def _slot_mapping(starts: torch.Tensor, counts: torch.Tensor, tables: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """[num_tokens] slots of every new token, sequences concatenated."""
    seq_of_token = torch.repeat_interleave(torch.arange(len(counts)), counts)  # [T]
    first_row = torch.cumsum(counts, 0) - counts
    positions = starts[seq_of_token] + torch.arange(int(counts.sum())) - first_row[seq_of_token]
    return _slots(tables[seq_of_token], positions[:, None], block_size)[:, 0]


def _causal_mask(q_pos: torch.Tensor, num_keys: int, sliding_window: int | None
                 ) -> torch.Tensor:
    """[..., num_keys] bool: key position <= query position (and within the window)."""
    k_pos = torch.arange(num_keys)
    mask = k_pos <= q_pos[..., None]
    if sliding_window is not None:
        mask &= k_pos > q_pos[..., None] - sliding_window
    return mask


def _decode_group(index: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                  token_starts: torch.Tensor, tables: torch.Tensor, block_size: int,
                  sliding_window: int | None, device) -> DecodeGroup:
    starts, counts, token_starts = starts[index], counts[index], token_starts[index]
    max_query = int(counts.max())
    max_len = int((starts + counts).max())
    t = torch.arange(max_query)
    is_valid = t < counts[:, None]  # [B, max_query]
    token_index = (token_starts[:, None] + t)[is_valid]
    padded_index = (torch.arange(len(index))[:, None] * max_query + t)[is_valid]
    positions = torch.arange(max_len).expand(len(index), max_len)  # [B, max_len]
    # Padded positions past a table's end read block 0; the mask never attends them.
    kv_index = _slots(tables[index], positions.clamp(max=tables.shape[1] * block_size - 1),
                      block_size)
    mask = _causal_mask(starts[:, None] + t, max_len, sliding_window)  # [B, max_query, L]
    return DecodeGroup(token_index.to(device), padded_index.to(device), kv_index.to(device),
                       mask.to(device), max_query)


def _prefill_sequence(seq: SequenceSlice, token_start: int, table: torch.Tensor,
                      block_size: int, sliding_window: int | None, device) -> PrefillSequence:
    total = seq.start_pos + seq.num_tokens
    kv_index = _slots(table[None], torch.arange(total)[None], block_size)[0]
    mask = None
    if seq.start_pos > 0 or (sliding_window is not None and total > sliding_window):
        mask = _causal_mask(torch.arange(seq.start_pos, total), total, sliding_window).to(device)
    return PrefillSequence(token_start, seq.num_tokens, kv_index.to(device), mask)


class FloatKV(NamedTuple):
    """One layer's KV cache in a float dtype: key, value [num_slots, num_kv_heads,
    head_dim] (a tuple, so `k, v = cache` reads it as before)."""

    key: torch.Tensor
    value: torch.Tensor

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store k, v ([num_tokens, num_kv_heads, head_dim]) at slots [num_tokens]."""
        self.key.index_copy_(0, slot_mapping, k.to(self.key.dtype))
        self.value.index_copy_(0, slot_mapping, v.to(self.value.dtype))

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` ([N] int64): two [N, num_kv_heads, head_dim]."""
        return self.key.index_select(0, slots), self.value.index_select(0, slots)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """`paged_attention` over this cache."""
        num_tokens, num_heads, head_dim = q.shape
        out = q.new_empty(num_tokens, num_heads * head_dim)
        if try_attention_bf16(q, self, meta.sequences, scale, meta.sliding_window, out):
            return out
        if not try_attention_f32(q, self, meta.sequences, scale, meta.sliding_window, out,
                                 MAX_DECODE_QUERY):  # the few-query sequences; prefills below
            attend_decodes(q, self, meta, scale, out)
        attend_prefills(q, self, meta, scale, out)
        return out


def layer_cache(kv_cache) -> FloatKV:
    """`kv_cache` as a layer cache object: a plain (key, value) tuple becomes a `FloatKV`;
    a cache object (`FloatKV`, `Int8KV`) is returned as it is."""
    return kv_cache if hasattr(kv_cache, "attend") else FloatKV(*kv_cache)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache, meta: AttentionMetadata) -> None:
    """Store the new keys/values k, v ([num_tokens, num_kv_heads, head_dim]) at their slots
    of `kv_cache` (a (key, value) tuple or a layer cache object)."""
    layer_cache(kv_cache).write(k, v, meta.slot_mapping)


def paged_attention(q: torch.Tensor, kv_cache, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention of every new token over its sequence's cached keys/values.

    Args:
        q: [num_tokens, num_heads, head_dim] queries (RoPE applied).
        kv_cache: (key, value) caches [num_slots, num_kv_heads, head_dim], or a layer cache
            object (`FloatKV`, `Int8KV`), already holding the new tokens (see
            `write_kv_cache`).
        meta: this forward's metadata.
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [num_tokens, num_heads * head_dim], in q's dtype. Query head h reads key/value head
        h // (num_heads // num_kv_heads) (grouped-query attention).
    """
    return layer_cache(kv_cache).attend(q, meta, scale)


def attend_decodes(q: torch.Tensor, kv, meta: AttentionMetadata, scale: float,
                   out: torch.Tensor) -> None:
    """The few-query sequences' rows of `out`, by the torch path's padded batches."""
    for group in meta.decodes:
        out[group.token_index] = _attend_decode(q, kv, group, scale)


def attend_prefills(q: torch.Tensor, kv, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor) -> None:
    """The many-query sequences' rows of `out`, by fused SDPA per sequence."""
    for seq in meta.prefills:
        rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
        out[rows] = _attend_prefill(q[rows], kv, seq, scale)


def _attend_decode(q: torch.Tensor, kv, group: DecodeGroup, scale: float) -> torch.Tensor:
    """[num_rows, q_size]: the padded batch's valid rows (order of group.token_index).

    Keys/values are gathered through the block tables once per key/value head and the
    queries of the heads that share one (grouped-query attention) are stacked into the rows
    of one matmul, in float32: softmax(q k^T * scale + mask) v. On CPU this is ~10x faster
    than `F.scaled_dot_product_attention` in bfloat16 at 1-16 query rows (whose fused kernel
    is built for long queries) and as fast in float32; `attend_decode_reference` is the SDPA
    form it is tested against.
    """
    _, num_heads, head_dim = q.shape
    num_kv_heads = kv.num_kv_heads
    group_size = num_heads // num_kv_heads
    batch, t = group.kv_index.shape[0], group.max_query
    q_pad = _pad_queries(q, group).view(batch, t, num_kv_heads, group_size, head_dim)
    q_pad = q_pad.permute(0, 2, 3, 1, 4)
    q_rows = q_pad.reshape(batch, num_kv_heads, group_size * t, head_dim).float()
    k, v = (_heads_major(rows, batch)  # [B, kv, L, hd] fp32
            for rows in kv.rows(group.kv_index.view(-1)))
    scores = torch.matmul(q_rows, k.transpose(-1, -2)).mul_(scale)  # [B, kv, g*t, L]
    scores = scores.view(batch, num_kv_heads, group_size, t, -1)
    scores.masked_fill_(~group.mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(batch, num_kv_heads, group_size * t, -1)
    out = torch.matmul(probs, v)  # [B, kv, g*t, hd]
    out = out.view(batch, num_kv_heads, group_size, t, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch * t, num_heads * head_dim)[group.padded_index].to(q.dtype)


def _pad_queries(q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    """q [num_tokens, heads, hd] -> [B * max_query, heads, hd]: the group's query rows at
    their padded positions, zeros elsewhere."""
    q_pad = q.new_zeros(group.kv_index.shape[0] * group.max_query, *q.shape[1:])
    q_pad[group.padded_index] = q[group.token_index]
    return q_pad


def _heads_major(rows: torch.Tensor, batch: int) -> torch.Tensor:
    """Gathered rows [B * L, kv_heads, hd] -> [B, kv_heads, L, hd] float32, contiguous (the
    head-major layout and the cast in one copy)."""
    return rows.view(batch, -1, *rows.shape[1:]).transpose(1, 2).to(
        torch.float32, memory_format=torch.contiguous_format)


def attend_decode_reference(q: torch.Tensor, kv_cache, group: DecodeGroup,
                            scale: float) -> torch.Tensor:
    """Plain SDPA reference of `_attend_decode` (same arguments and result)."""
    kv = layer_cache(kv_cache)
    _, num_heads, head_dim = q.shape
    batch, t = group.kv_index.shape[0], group.max_query
    q_pad = _pad_queries(q, group)
    k, v = (rows.to(q.dtype).view(batch, -1, *rows.shape[1:])  # [B, L, kv, hd]
            for rows in kv.rows(group.kv_index.view(-1)))
    out = F.scaled_dot_product_attention(
        q_pad.view(batch, t, num_heads, head_dim).transpose(1, 2),  # [B, heads, t, hd]
        k.transpose(1, 2), v.transpose(1, 2),  # [B, kv_heads, L, hd]
        attn_mask=group.mask[:, None], scale=scale,
        enable_gqa=num_heads != kv.num_kv_heads)  # [B, heads, t, hd]
    return out.transpose(1, 2).reshape(batch * t, num_heads * head_dim)[group.padded_index]


def _attend_prefill(q: torch.Tensor, kv, seq: PrefillSequence, scale: float) -> torch.Tensor:
    """[num_tokens, q_size] by fused SDPA over the sequence's gathered keys/values."""
    num_tokens, num_heads, head_dim = q.shape
    k, v = (rows.to(q.dtype).transpose(0, 1)  # [kv_heads, L, hd]
            for rows in kv.rows(seq.kv_index))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),  # [1, h, T|L, hd]
        attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale,
        enable_gqa=num_heads != k.shape[0])
    return out.squeeze(0).transpose(0, 1).reshape(num_tokens, num_heads * head_dim)
