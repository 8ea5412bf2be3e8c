"""The decode/verification attention path agrees with its SDPA reference and with attention
computed sequence by sequence, through shuffled block tables."""

from __future__ import annotations

import pytest
from kernel_checks import require_kernel
import torch
import torch.nn.functional as F

from specmoe.kernels.attention import kernel_unavailable_reason as attention_unavailable
from specmoe.layers.paged_attention import (AttentionMetadata, SequenceSlice,
                                            attend_decode_reference, paged_attention)

BLOCK_SIZE = 4


SHAPES = [(0, 1), (3, 1), (17, 5), (40, 1), (9, 16), (25, 3), (70, 2)]


def _setup(num_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int = 0,
           head_dim: int = 8, shapes=SHAPES, block_size: int = BLOCK_SIZE):
    """Sequences (start_pos, num_tokens) of mixed context and query lengths in shuffled
    blocks of one cache, their queries and a full key/value history per sequence."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(start + n) // block_size) for start, n in shapes)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs, hist = [], []
    k_cache = torch.zeros(num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for start, n in shapes:
        num = -(-(start + n) // block_size)
        blocks, perm = perm[:num], perm[num:]
        seqs.append(SequenceSlice(start, n, blocks))
        k = torch.randn(start + n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(start + n, num_kv_heads, head_dim, generator=g).to(dtype)
        for pos in range(start + n):
            slot = blocks[pos // block_size] * block_size + pos % block_size
            k_cache[slot], v_cache[slot] = k[pos], v[pos]
        hist.append((k, v))
    num_tokens = sum(n for _, n in shapes)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    return seqs, q, (k_cache, v_cache), hist


def _per_sequence(seqs, q, hist, scale, window=None):
    """fp32 causal attention of each sequence alone ([num_tokens, heads * hd])."""
    rows, t0 = [], 0
    for s, (k, v) in zip(seqs, hist):
        qs = q[t0:t0 + s.num_tokens].float().transpose(0, 1)  # [h, n, hd]
        q_pos = torch.arange(s.start_pos, s.start_pos + s.num_tokens)[:, None]
        k_pos = torch.arange(s.start_pos + s.num_tokens)[None]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        out = F.scaled_dot_product_attention(
            qs[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
            attn_mask=mask, scale=scale, enable_gqa=True)[0]  # [h, n, hd]
        rows.append(out.transpose(0, 1).reshape(s.num_tokens, -1))
        t0 += s.num_tokens
    return torch.cat(rows)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_path_matches_reference_and_per_sequence(num_heads, num_kv_heads, dtype, tol):
    seqs, q, cache, hist = _setup(num_heads, num_kv_heads, dtype)
    scale = 8 ** -0.5
    meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu")
    assert not meta.prefills and len(meta.decodes) > 1  # several length groups
    out = paged_attention(q, cache, meta, scale)
    assert out.dtype == dtype
    expected = _per_sequence(seqs, q, hist, scale)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    reference = torch.empty_like(out)
    for group in meta.decodes:
        reference[group.token_index] = attend_decode_reference(q, cache, group, scale)
    torch.testing.assert_close(out.float(), reference.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (12, 2, 128),
                                                             (16, 1, 64), (32, 8, 128),
                                                             (9, 3, 64), (14, 2, 64),
                                                             (10, 2, 80), (8, 8, 96),
                                                             (6, 2, 176), (4, 1, 256)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [BLOCK_SIZE, 16])
def test_native_decode_kernel_matches_torch_path(num_heads, num_kv_heads, head_dim, window,
                                                block_size, kernels_off):
    """bf16: the native kernel (chunks of 16 keys, query vectors in blocks of 16 and groups
    of 4, head_dim 16 to 256, odd multiples of 16 included; blocks of 4 slots and of 16,
    whose chunks each lie in one block) against the torch path and per-sequence fp32
    attention, sliding window included; its error (bf16 softmax weights in P V) within 1.5x
    the torch path's (measured 1.2-1.35x)."""
    require_kernel("attention kernel", attention_unavailable())
    shapes = SHAPES + [(130, 8), (31, 16), (15, 1)]
    seqs, q, cache, hist = _setup(num_heads, num_kv_heads, torch.bfloat16, 3, head_dim, shapes,
                                  block_size)
    scale = head_dim ** -0.5
    meta = AttentionMetadata.build(seqs, block_size, "cpu", sliding_window=window)
    out = paged_attention(q, cache, meta, scale)
    with kernels_off():
        torch_path = paged_attention(q, cache, meta, scale)
    torch.testing.assert_close(out.float(), torch_path.float(), atol=2e-2, rtol=2e-2)
    expected = _per_sequence(seqs, q, hist, scale, window)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    # The kernel rounds the softmax weights to bf16 before P V (as FlashAttention does): its
    # error against fp32 attention stays within a small factor of the torch path's, whose
    # only error is the bf16 rounding of the output.
    err = (out.float() - expected).abs().mean().item()
    torch_err = (torch_path.float() - expected).abs().mean().item()
    assert err < 1.5 * torch_err, (err, torch_err)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (12, 2, 128),
                                                             (4, 4, 16)])
@pytest.mark.parametrize("window", [None, 40])
def test_native_kernel_attends_prefill_and_decode_rows_in_one_call(num_heads, num_kv_heads,
                                                                   head_dim, window,
                                                                   kernels_off):
    """A forward mixing a fresh prefill, a chunked prefill continuing a cached prefix,
    verification rows and a decode row: the kernel writes every row, and they agree with
    the torch path (fused SDPA for the prefills) and with per-sequence fp32 attention."""
    require_kernel("attention kernel", attention_unavailable())
    shapes = [(0, 70), (12, 3), (0, 1), (33, 50), (90, 1)]
    seqs, q, cache, hist = _setup(num_heads, num_kv_heads, torch.bfloat16, 4, head_dim, shapes)
    scale = head_dim ** -0.5
    meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu", sliding_window=window)
    out = paged_attention(q, cache, meta, scale)
    assert meta._decodes is None and meta._prefills is None  # the kernel served every row
    with kernels_off():
        torch_path = paged_attention(q, cache, meta, scale)
    assert len(meta.prefills) == 2 and len(meta.decodes) >= 1
    torch.testing.assert_close(out.float(), torch_path.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), _per_sequence(seqs, q, hist, scale, window),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(12, 2, 128, BLOCK_SIZE),
                                                                        (9, 3, 80, 16),
                                                                        (4, 4, 32, 16),
                                                                        (130, 1, 16, 16)])
def test_native_kernel_rows_are_batch_invariant_bit_for_bit(window, num_heads, num_kv_heads,
                                                            head_dim, block_size):
    """Each query row's output has the same bits computed with the other rows and sequences
    of a forward as alone (decode at its own position): verification of K + 1 rows gives a
    token what plain decoding gives it. Compared as int16 bit patterns (torch.equal would
    take -0 for +0)."""
    require_kernel("attention kernel", attention_unavailable())
    # (0, 100): several work units per KV head (96 rows of G = 1, 32 of G = 3, 16 of G = 6,
    # one row of G = 130)
    shapes = [(0, 20), (117, 5), (140, 1), (91, 16), (3, 9), (200, 16), (0, 100)]
    seqs, q, cache, _ = _setup(num_heads, num_kv_heads, torch.bfloat16, 5, head_dim, shapes,
                               block_size)
    scale = head_dim ** -0.5
    together = paged_attention(q, cache, AttentionMetadata.build(
        seqs, block_size, "cpu", sliding_window=window), scale)
    row = 0
    for s in seqs:
        for r in range(s.num_tokens):
            alone = paged_attention(q[row:row + 1], cache, AttentionMetadata.build(
                [SequenceSlice(s.start_pos + r, 1, s.block_ids)], block_size, "cpu",
                sliding_window=window), scale)
            assert torch.equal(alone[0].view(torch.int16), together[row].view(torch.int16)), (s, r)
            row += 1


def _require_f32_kernel():
    from specmoe.kernels import attention, gemv
    from specmoe.kernels.build import cpu_reason
    if attention._lazy_f32.get() is None:
        if cpu_reason(("avx2", "fma")) is None and gemv.is_enabled():
            pytest.fail(f"float32 attention kernel did not build: {attention._lazy_f32.unavailable}")
        pytest.skip(f"float32 attention kernel unavailable: {attention._lazy_f32.unavailable}")


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (12, 2, 128),
                                                             (9, 3, 64), (6, 2, 8)])
def test_float32_kernel_matches_per_sequence_attention(num_heads, num_kv_heads, head_dim,
                                                       window, kernels_off):
    """float32: the AVX2 kernel against per-sequence fp32 SDPA and the torch path, prefill,
    verification and decode rows in one call, sliding window included."""
    _require_f32_kernel()
    shapes = SHAPES + [(130, 8), (0, 33)]
    seqs, q, cache, hist = _setup(num_heads, num_kv_heads, torch.float32, 6, head_dim, shapes)
    scale = head_dim ** -0.5
    meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu", sliding_window=window)
    out = paged_attention(q, cache, meta, scale)
    assert meta._decodes is None  # the kernel took the few-query sequences, SDPA the rest
    torch.testing.assert_close(out, _per_sequence(seqs, q, hist, scale, window),
                               atol=1e-5, rtol=1e-5)
    with kernels_off():
        torch.testing.assert_close(out, paged_attention(q, cache, meta, scale),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 37])
def test_float32_kernel_rows_are_batch_invariant_bit_for_bit(window):
    """Each float32 row of a sequence of at most 16 query rows (decode, verification) has
    the bits it gets alone at its own position, whatever shares the forward (a long
    prefill included): greedy speculation on a float32 target equals plain decoding."""
    _require_f32_kernel()
    seqs, q, cache, _ = _setup(12, 2, torch.float32, 7, 64, INVARIANCE_SHAPES, 16)
    assert_rows_alone_equal_together(seqs, q, cache, window)


INVARIANCE_SHAPES = [(0, 12), (117, 5), (140, 1), (3, 9), (60, 16), (0, 40)]


def assert_rows_alone_equal_together(seqs, q, cache, window, block_size: int = 16):
    """Every row of the few-query sequences (all but the last, a prefill for SDPA) has the
    same float32 bits attended alone at its position as in the whole batch."""
    scale = q.shape[2] ** -0.5
    together = paged_attention(q, cache, AttentionMetadata.build(
        seqs, block_size, "cpu", sliding_window=window), scale)
    row = 0
    for s in seqs[:-1]:
        for r in range(s.num_tokens):
            alone = paged_attention(q[row:row + 1], cache, AttentionMetadata.build(
                [SequenceSlice(s.start_pos + r, 1, s.block_ids)], block_size, "cpu",
                sliding_window=window), scale)
            assert torch.equal(alone[0].view(torch.int32), together[row].view(torch.int32))
            row += 1
