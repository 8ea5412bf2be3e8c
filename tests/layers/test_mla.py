"""Multi-head Latent Attention (`specmoe.layers.mla`, `specmoe.layers.mla_attention`): the
absorbed decode form, the decompressed reference and a dense per-sequence transcription of
DeepSeek's attention agree over a paged latent cache with shuffled block tables; YaRN and
the softmax scale match transformers; bad MLA configs are rejected."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specmoe.config import ArchConfig, MLAConfig
from specmoe.layers.mla import MLAttention, mla_softmax_scale
from specmoe.layers.paged_attention import AttentionMetadata, SequenceSlice
from specmoe.layers.rotary import RotaryEmbedding, rope_attention_factor, rope_inv_freq

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEADS, NOPE, ROPE, V, RANK, HIDDEN = 4, 16, 8, 12, 24, 48
BLOCK, NUM_BLOCKS = 4, 24


def _arch(q_lora_rank: int | None, interleave: bool) -> ArchConfig:
    mla = MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=RANK, qk_nope_head_dim=NOPE,
                    qk_rope_head_dim=ROPE, v_head_dim=V, rope_interleave=interleave)
    return ArchConfig(architecture="DeepseekV3ForCausalLM", vocab_size=10, hidden_size=HIDDEN,
                      intermediate_size=32, num_hidden_layers=1, num_attention_heads=HEADS,
                      num_key_value_heads=HEADS, head_dim=ROPE, rms_norm_eps=1e-6,
                      rope_theta=10000.0, max_position_embeddings=128, mla=mla)


def _attention(q_lora_rank: int | None, interleave: bool) -> MLAttention:
    arch = _arch(q_lora_rank, interleave)
    attn = MLAttention(arch, RotaryEmbedding(ROPE, 128, arch.rope_theta))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "layernorm" in name else 0.3 * noise)
    return attn.eval()


def _rope_pairs(x: torch.Tensor, pos: torch.Tensor, interleave: bool) -> torch.Tensor:
    """DeepSeek's RoPE as transformers writes it: V2's complex product on the pairs
    (2i, 2i + 1) (output kept interleaved), or rotate_half on the halves."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE))
    ang = (pos[:, None].double() * inv).float()  # [T, rope / 2]
    if interleave:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        rot = torch.polar(torch.ones_like(ang), ang)[:, None]
        return torch.view_as_real(xc * rot).flatten(-2)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _dense_reference(attn: MLAttention, x: torch.Tensor, interleave: bool) -> torch.Tensor:
    """One whole sequence from position 0: per-head keys and values decompressed from the
    latent, causal softmax attention, o_proj (transformers' DeepseekV2Attention, eager)."""
    t = x.shape[0]
    pos = torch.arange(t)
    q = attn._query(x).view(t, HEADS, NOPE + ROPE)
    kv = attn.kv_a_proj_with_mqa(x)
    c_kv = attn.kv_a_layernorm(kv[:, :RANK])
    q_pe = _rope_pairs(q[..., NOPE:], pos, interleave)
    k_pe = _rope_pairs(kv[:, None, RANK:], pos, interleave)  # [T, 1, rope]
    kvh = (c_kv @ attn.kv_b_proj.weight.T).view(t, HEADS, NOPE + V)
    k = torch.cat([kvh[..., :NOPE], k_pe.expand(t, HEADS, ROPE)], dim=-1)
    q = torch.cat([q[..., :NOPE], q_pe], dim=-1)
    scores = torch.einsum("thd,shd->hts", q, k) * (NOPE + ROPE) ** -0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hts,shv->thv", scores.softmax(-1), kvh[..., NOPE:])
    return attn.o_proj(out.reshape(t, HEADS * V))


def _run_chunks(attn: MLAttention, xs: list[torch.Tensor], chunks: list[list[int]]
                ) -> list[torch.Tensor]:
    """Feed the sequences xs in batched forwards of chunks[step][i] tokens each (0: the
    sequence sits out) through one latent cache with shuffled block tables; the outputs of
    each sequence concatenated."""
    cache = (torch.zeros(NUM_BLOCKS * BLOCK, RANK + ROPE),)
    pool = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [[pool.pop() for _ in range(-(-len(x) // BLOCK))] for x in xs]
    starts, outs = [0] * len(xs), [[] for _ in xs]
    for step in chunks:
        batch = [(i, n) for i, n in enumerate(step) if n]
        meta = AttentionMetadata.build(
            [SequenceSlice(starts[i], n, tables[i]) for i, n in batch], BLOCK, "cpu")
        x = torch.cat([xs[i][starts[i]:starts[i] + n] for i, n in batch])
        pos = torch.cat([torch.arange(starts[i], starts[i] + n) for i, n in batch])
        out = attn(x, pos, cache, meta)
        for (i, n), o in zip(batch, out.split([n for _, n in batch])):
            outs[i].append(o)
            starts[i] += n
    assert starts == [len(x) for x in xs]
    return [torch.cat(o) for o in outs]


# Prefill chunks over 16 tokens take the decompressed path; the rest (decode, verification
# windows, short chunks with an offset) the absorbed one.
CHUNKS = [[20, 3, 1], [1, 5, 17], [4, 1, 2], [1, 0, 1]]
LENGTHS = [26, 9, 21]


@pytest.mark.parametrize("q_lora_rank", [None, 20], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("interleave", [True, False], ids=["pairs", "halves"])
def test_absorbed_decompressed_and_dense_reference_agree(q_lora_rank, interleave):
    attn = _attention(q_lora_rank, interleave)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, HIDDEN, generator=g) for n in LENGTHS]
    with torch.no_grad():
        absorbed = _run_chunks(attn, xs, CHUNKS)
        attn.absorb = False
        decompressed = _run_chunks(attn, xs, CHUNKS)
        dense = [_dense_reference(attn, x, interleave) for x in xs]
    for a, d, r in zip(absorbed, decompressed, dense):
        assert r.abs().max() > 0.5  # not vacuous
        torch.testing.assert_close(a, d, atol=2e-5, rtol=0)
        torch.testing.assert_close(a, r, atol=2e-5, rtol=0)


def test_cache_rows_are_the_latent_and_the_rotated_shared_key():
    """The cache row of a token is [kv_a_layernorm(c_kv) | RoPE(k_pe)] (halves layout):
    kv_lora_rank + qk_rope_head_dim values, nothing per head."""
    attn = _attention(None, interleave=False)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    cache = (torch.zeros(2 * BLOCK, RANK + ROPE),)
    meta = AttentionMetadata.build([SequenceSlice(0, 5, [1, 0])], BLOCK, "cpu")
    with torch.no_grad():
        attn(x, torch.arange(5), cache, meta)
        kv = attn.kv_a_proj_with_mqa(x)
        want = torch.cat([attn.kv_a_layernorm(kv[:, :RANK]),
                          _rope_pairs(kv[:, None, RANK:], torch.arange(5), False)[:, 0]], -1)
    slots = [4, 5, 6, 7, 0]  # block 1 then block 0
    torch.testing.assert_close(cache[0][slots], want, atol=1e-6, rtol=0)


def _yarn_config(**rope) -> transformers.DeepseekV3Config:
    params = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=64,
                  beta_fast=32, beta_slow=1, rope_theta=10000.0, **rope)
    return transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=None,
        max_position_embeddings=2560, rope_parameters=params)


@pytest.mark.parametrize("rope", [dict(mscale=1.0, mscale_all_dim=1.0),
                                  dict(mscale=0.707, mscale_all_dim=1.0), {}],
                         ids=["deepseek_v3", "mscale_ratio", "plain_yarn"])
def test_yarn_frequencies_factor_and_scale_match_transformers(rope):
    cfg = _yarn_config(**rope)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    scaling = {k: v for k, v in cfg.rope_parameters.items() if k != "rope_theta"}
    torch.testing.assert_close(rope_inv_freq(16, 10000.0, scaling), inv_freq, atol=0, rtol=0)
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)
    mla = MLAConfig(None, 32, 16, 16, 16)
    hf_scale = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(
        cfg, 0).scaling
    assert mla_softmax_scale(mla, scaling) == pytest.approx(hf_scale, rel=1e-12)
    if rope.get("mscale_all_dim"):
        assert hf_scale > 32 ** -0.5 * 1.1  # the mscale^2 term is in play
    assert mla_softmax_scale(mla, None) == 32 ** -0.5


def test_yarn_without_factor_is_rejected():
    with pytest.raises(ValueError, match="factor"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "original_max_position_embeddings": 8})


@pytest.mark.parametrize("field, value", [("kv_lora_rank", 0), ("qk_rope_head_dim", 7),
                                          ("q_lora_rank", 0), ("v_head_dim", 1.5)])
def test_bad_mla_config_names_the_value(field, value):
    kw = dict(q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=8)
    kw[field] = value
    with pytest.raises(ValueError, match=f"{field}={value}"):
        MLAConfig(**kw)


def test_mla_config_sizes():
    mla = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128)
    assert (mla.qk_head_dim, mla.latent_dim) == (192, 576)
    arch = _arch(None, True)
    assert arch.kv_cache_values_per_token == RANK + ROPE
    h = HIDDEN
    want = (h * HEADS * (NOPE + ROPE) + h * (RANK + ROPE) + RANK * HEADS * (NOPE + V)
            + HEADS * V * h)
    assert arch.attention_params == want
    assert math.isclose(MLAttention(arch, RotaryEmbedding(ROPE, 8, 1e4)).scale,
                        (NOPE + ROPE) ** -0.5)
