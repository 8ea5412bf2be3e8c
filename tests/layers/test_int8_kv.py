"""The int8 KV cache: per-row quantisation, the AVX2 kernel against the plain-torch path over
the dequantised rows, batch invariance, and the cache's size."""

from __future__ import annotations

import pytest
from layers.test_mla import _arch as mla_arch
from layers.test_paged_attention import (BLOCK_SIZE, INVARIANCE_SHAPES, SHAPES, _per_sequence,
                                        _setup, assert_rows_alone_equal_together)
import torch

from specmoe.config import ArchConfig, SchedulerConfig
from specmoe.layers.int8_kv import Int8KV, dequantize_rows, quantize_rows
from specmoe.layers.paged_attention import (AttentionMetadata,
                                            attend_decode_reference, paged_attention)
from specmoe.worker.kv_cache import PagedKVCache, kv_bytes_per_token


def _require_int8_kernel():
    from specmoe.kernels import attention, gemv
    from specmoe.kernels.build import cpu_reason
    if attention._lazy_int8.get() is None:
        if cpu_reason(("avx2", "fma")) is None and gemv.is_enabled():
            pytest.fail(f"int8 attention kernel did not build: {attention._lazy_int8.unavailable}")
        pytest.skip(f"int8 attention kernel unavailable: {attention._lazy_int8.unavailable}")


def _int8_setup(num_heads, num_kv_heads, head_dim, shapes, seed=0, block_size=BLOCK_SIZE):
    """`_setup`'s sequences with the cache quantised to an `Int8KV` and each history
    replaced by its dequantised rows (what attention over the cache should see)."""
    seqs, q, (k_cache, v_cache), hist = _setup(num_heads, num_kv_heads, torch.float32, seed,
                                               head_dim, shapes, block_size)
    cache = Int8KV.zeros(k_cache.shape[0], num_kv_heads, head_dim, "cpu")
    cache.write(k_cache, v_cache, torch.arange(k_cache.shape[0]))
    hist = [tuple(dequantize_rows(*quantize_rows(x)) for x in kv) for kv in hist]
    return seqs, q, cache, hist


def test_quantize_rows_is_within_half_a_step_and_per_row():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-6, 3, 50)[:, None, None]
    x[7, 1] = 0.0
    codes, scale = quantize_rows(x)
    assert codes.dtype is torch.int8 and scale.dtype is torch.float32
    assert scale.shape == (50, 3) and int(codes.abs().max()) == 127
    err = (dequantize_rows(codes, scale) - x).abs()
    assert bool((err <= scale[..., None] * 0.5 * (1 + 1e-6) + 1e-30).all())
    assert scale[7, 1] == 0 and not codes[7, 1].any()
    alone = quantize_rows(x[20:21])  # a row's bits do not depend on the other rows
    assert torch.equal(alone[0][0], codes[20]) and torch.equal(alone[1][0], scale[20])
    bf16 = quantize_rows(x.bfloat16())
    assert torch.equal(bf16[0], quantize_rows(x.bfloat16().float())[0])


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (12, 2, 128),
                                                             (9, 3, 64), (6, 2, 8)])
def test_int8_kernel_matches_torch_path_and_dequantised_attention(
        num_heads, num_kv_heads, head_dim, window, kernels_off):
    """Prefill, verification and decode rows in one call: the kernel (few-query rows) and
    SDPA (prefills) against fp32 attention over the dequantised history, and against the
    plain-torch path with kernels off."""
    _require_int8_kernel()
    seqs, q, cache, hist = _int8_setup(num_heads, num_kv_heads, head_dim,
                                       SHAPES + [(130, 8), (0, 33)], seed=6)
    scale = head_dim ** -0.5
    meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu", sliding_window=window)
    out = paged_attention(q, cache, meta, scale)
    assert meta._decodes is None  # the kernel took the few-query sequences
    expected = _per_sequence(seqs, q, hist, scale, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with kernels_off():
        meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu", sliding_window=window)
        torch.testing.assert_close(out, paged_attention(q, cache, meta, scale),
                                   atol=1e-5, rtol=1e-5)
        for group in meta.decodes:
            torch.testing.assert_close(
                out[group.token_index], attend_decode_reference(q, cache, group, scale),
                atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 37])
def test_int8_kernel_rows_are_batch_invariant_bit_for_bit(window):
    """A few-query row has the bits it gets alone at its own position, whatever shares the
    forward: greedy speculation over an int8 cache equals plain decoding over it."""
    _require_int8_kernel()
    seqs, q, cache, _ = _int8_setup(12, 2, 64, INVARIANCE_SHAPES, seed=7, block_size=16)
    assert_rows_alone_equal_together(seqs, q, cache, window)


def test_bfloat16_queries_over_int8_cache_are_computed_in_float32():
    seqs, q, cache, hist = _int8_setup(8, 2, 32, SHAPES, seed=3)
    meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu")
    out = paged_attention(q.bfloat16(), cache, meta, 32 ** -0.5)
    assert out.dtype is torch.bfloat16
    expected = _per_sequence(seqs, q.bfloat16().float(), hist, 32 ** -0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_int8_cache_size_and_refusals():
    arch = ArchConfig(architecture="Qwen2ForCausalLM", vocab_size=10, hidden_size=64,
                      intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=128)
    per_token = kv_bytes_per_token(arch, torch.int8)
    assert per_token == 3 * 2 * 2 * (16 + 4)
    assert kv_bytes_per_token(arch, torch.bfloat16) == 3 * 2 * 2 * 16 * 2
    cache = PagedKVCache(arch, 3, 16, torch.int8, "cpu")
    assert cache.num_bytes == PagedKVCache.bytes_per_block(arch, 16, torch.int8) * 3
    assert all(isinstance(layer, Int8KV) for layer in cache.layers)
    with pytest.raises(ValueError, match="kv_cache_dtype='float8'"):
        SchedulerConfig(kv_cache_dtype="float8")
    with pytest.raises(ValueError, match="Multi-Head Latent Attention"):
        PagedKVCache(mla_arch(None, False), 3, 16, torch.int8, "cpu")
