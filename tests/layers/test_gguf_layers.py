"""GGUF layers (`specmoe.layers.gguf_layers`) against their plain-torch references: mixed
shard types, a dense shard, a tied head, experts whose gate and up share a type or not, and
a token's output independent of the other tokens."""

from __future__ import annotations

import pytest
import torch

from specmoe.kernels import gguf_gemm
from specmoe.kernels.gguf_gemm import GGUFWeight, dequantize_reference
from specmoe.layers.gguf_layers import GGUFEmbedding, GGUFLinear, GGUFRoutedExperts
from tests.gguf_blocks import random_blocks, random_weight

Q = gguf_gemm.Q


@pytest.fixture(autouse=True)
def built():
    if gguf_gemm.kernel() is None:
        pytest.skip(f"GGUF block kernel unavailable: {gguf_gemm._lazy.unavailable}")


def _stack(t, n, out, k, seed):
    blocks = torch.from_numpy(random_blocks(t, n * out, k, seed)).reshape(n, out, -1)
    return GGUFWeight(int(t), blocks, k)


def test_linear_with_mixed_shards_matches_its_reference():
    parts = [random_weight(Q.Q4_K, 64, 256, 1), random_weight(Q.Q5_0, 32, 256, 2),
             torch.randn(32, 256)]
    layer = GGUFLinear(parts, torch.randn(128))
    x = torch.randn(5, 256)
    torch.testing.assert_close(layer(x), layer.forward_reference(x), rtol=1e-5, atol=1e-4)
    assert torch.equal(layer(x[2:3])[:, :96], layer(x)[2:3, :96])  # the block shards
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_embedding_and_a_tied_head_share_the_blocks():
    weight = random_weight(Q.Q6_K, 40, 256, 3)
    embedding = GGUFEmbedding(weight, torch.bfloat16)
    ids = torch.tensor([[3, 39], [0, 3]])
    assert torch.equal(embedding(ids), dequantize_reference(weight)[ids].bfloat16())
    head = GGUFLinear(None, None, weight_source=embedding.weight_parts)
    assert not list(head.buffers())  # no second copy
    x = torch.randn(2, 256)
    torch.testing.assert_close(head(x), head.forward_reference(x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("up_type", [Q.Q4_K, Q.Q8_0], ids=["joined", "separate"])
def test_experts_match_their_reference(up_type):
    n, inter, hidden = 6, 64, 256
    experts = GGUFRoutedExperts(_stack(Q.Q4_K, n, inter, hidden, 1),
                                _stack(up_type, n, inter, hidden, 2),
                                _stack(Q.Q8_0, n, hidden, inter, 3))
    assert len(experts.gate_up) == (1 if up_type == Q.Q4_K else 2)
    x = torch.randn(7, hidden)
    ids = torch.tensor([[0, 5], [5, 2], [2, 2 + 1], [1, 4], [4, 0], [3, 5], [0, 1]])
    weights = torch.rand(7, 2)
    got = experts(x, ids, weights)
    ref = experts.forward_reference(x, ids, weights)
    # down's input is rounded to int8 again: float noise may move a value across a rounding
    # boundary there, changing an output by one step of that rounding
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
    assert torch.equal(experts(x[3:4], ids[3:4], weights[3:4]), got[3:4])
    loop = experts.forward_loop(x, ids, weights)  # the same sums but torch's SiLU
    torch.testing.assert_close(got, loop, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
    many = torch.randint(0, 6, (40, 2))  # several rows per expert: the unpacked form
    many[:, 1] = (many[:, 0] + 1) % 6
    xs, ws = torch.randn(40, hidden), torch.rand(40, 2)
    assert torch.equal(experts(xs, many, ws)[17:18], experts(xs[17:18], many[17:18], ws[17:18]))
    with pytest.raises(IndexError, match=r"\[0, 6\)"):
        experts(x[:1], torch.tensor([[0, 6]]), weights[:1])
