"""The native RMSNorm, RoPE and SiLU-and-mul kernels give the torch references' bf16 results
(bit for bit in practice: the same fp32 operations in the same order), on strided views as
the decoder passes them, and decline what they do not take."""

from __future__ import annotations

import pytest
import torch

from specmoe import kernels
from specmoe.kernels import elementwise
from specmoe.layers.mlp import silu_and_mul
from specmoe.layers.norm import RMSNorm
from specmoe.layers.rotary import RotaryEmbedding


KERNEL_UNAVAILABLE_REASON = elementwise._lazy.unavailable_reason  # for `enabled`


@pytest.fixture
def both(kernels_off):
    """both(fn): fn() with the kernels on, then off (the torch reference)."""
    def run(fn):
        out = fn()
        with kernels_off():
            return out, fn()
    return run


def _assert_bf16_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=2 ** -7)
    assert (out == ref).float().mean() > 0.99


@pytest.mark.parametrize("rows", [1, 5, 16, 300])
@pytest.mark.parametrize("hidden", [64, 576, 2048])
def test_rms_norm_matches_reference(enabled, both, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    norm = RMSNorm(hidden, 1e-6).bfloat16()
    norm.weight.data = torch.randn(hidden, generator=g).bfloat16()
    x = (torch.randn(rows, hidden, generator=g) * 4).bfloat16()
    with torch.no_grad():
        out, ref = both(lambda: norm(x))
        _assert_bf16_equal(out, ref)
        wide = (torch.randn(rows, 3 * hidden, generator=g)).bfloat16()
        view = wide[:, hidden:2 * hidden]  # strided rows, as a split projection
        out, ref = both(lambda: norm(view))
        _assert_bf16_equal(out, ref)
        out, ref = both(lambda: norm(x.view(rows, 1, hidden)))  # 3-D contiguous
        _assert_bf16_equal(out, ref)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (12, 2, 128), (4, 4, 32)])
def test_rotary_matches_reference_on_fused_qkv_views(enabled, both, rows, heads, kv_heads,
                                                     head_dim):
    g = torch.Generator().manual_seed(rows)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(rows, q_size + 2 * kv_size, generator=g).bfloat16()
    positions = torch.randint(0, 4096, (rows,), generator=g)

    def rotate():
        q, k, _ = qkv.clone().split([q_size, kv_size, kv_size], dim=-1)
        return rope(positions, q.reshape(rows, heads, head_dim),
                    k.reshape(rows, kv_heads, head_dim))

    (q, k), (q_ref, k_ref) = both(rotate)
    _assert_bf16_equal(q, q_ref)
    _assert_bf16_equal(k, k_ref)


@pytest.mark.parametrize("rows", [1, 16, 200])
@pytest.mark.parametrize("inter", [16, 1536, 8960])
def test_silu_and_mul_matches_reference(enabled, both, rows, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 6).bfloat16()
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # exp under- and overflow
    out, ref = both(lambda: silu_and_mul(gate_up))
    _assert_bf16_equal(out, ref)


def test_kernels_decline_what_they_do_not_take(enabled):
    x32 = torch.randn(2, 64)
    assert elementwise.try_rms_norm_bf16(x32, torch.ones(64), 1e-6) is None  # fp32
    xb = torch.randn(2, 40).bfloat16()
    assert elementwise.try_rms_norm_bf16(xb, torch.ones(40).bfloat16(), 1e-6) is None  # H % 16
    assert elementwise.try_rms_norm_bf16(torch.randn(4, 64).bfloat16().t(),
                                         torch.ones(4).bfloat16(), 1e-6) is None  # strided
    q = torch.randn(3, 2, 64).bfloat16()
    k = torch.randn(3, 1, 64).bfloat16()
    cos = sin = torch.zeros(10, 32)
    before = q.clone()
    assert not elementwise.try_rotary_bf16(torch.tensor([0, 1, 10]), q, k, cos, sin)  # position
    assert torch.equal(q, before)  # nothing written
    q48 = torch.randn(3, 2, 48).bfloat16()
    assert not elementwise.try_rotary_bf16(torch.tensor([0, 1, 2]), q48, q48[:, :1],
                                           torch.zeros(10, 24), torch.zeros(10, 24))  # hd % 32
    assert elementwise.try_silu_and_mul_bf16(torch.randn(2, 40).bfloat16()) is None  # I % 16
    kernels.set_enabled(False)  # the `enabled` fixture restores the switch
    assert elementwise.try_silu_and_mul_bf16(torch.randn(2, 64).bfloat16()) is None
