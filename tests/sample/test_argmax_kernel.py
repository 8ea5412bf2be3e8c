"""The native argmax of float32 rows is torch.argmax bit for bit, and falls back to it."""

from __future__ import annotations

import pytest
import torch

from specmoe import kernels
from specmoe.kernels import argmax as argmax_kernel
from specmoe.kernels.argmax import argmax, try_argmax


KERNEL_UNAVAILABLE_REASON = argmax_kernel._lazy.unavailable_reason  # for the `enabled` fixture


@pytest.mark.parametrize("shape", [(1, 1), (1, 15), (2, 16), (3, 17), (16, 49152), (1, 151936),
                                   (2, 3, 100), (5000, 33), (0, 5), (2, 0, 7), (300,)])
def test_matches_torch_on_random_rows(enabled, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    assert torch.equal(try_argmax(x), x.argmax(dim=-1))


def test_ties_infinities_and_nan_rank_as_torch_ranks_them(enabled):
    x = torch.randn(7, 70, generator=torch.Generator().manual_seed(0))
    x[0, [5, 40, 69]] = 50.0                        # ties: the first
    x[1, 33] = float("inf")
    x[2] = float("-inf")                            # all -inf: index 0
    x[3, [60, 20]] = float("nan")                   # NaN above all: the first NaN
    x[3, 10] = float("inf")
    x[4, 69] = float("nan")                         # NaN in the tail lanes
    x[5] = 0.0
    x[5, 30] = -0.0                                 # signed zeros tie
    x[6, 65] = 1e30                                 # max in the tail
    assert torch.equal(try_argmax(x), x.argmax(dim=-1))
    assert try_argmax(x).tolist()[:5] == [5, 33, 0, 20, 69]


def test_strided_overlapping_and_expanded_rows(enabled):
    base = torch.randn(16, 3, 1000, generator=torch.Generator().manual_seed(1))
    rows = base[:, 1]  # 2-D, unit stride inside rows
    assert not rows.is_contiguous()
    flat = torch.randn(100, generator=torch.Generator().manual_seed(2))
    overlapping = flat.as_strided((5, 40), (7, 1))  # stride(0) < n
    expanded = flat[:40].expand(3, 40)  # stride(0) == 0
    for x in (rows, overlapping, expanded):
        assert torch.equal(try_argmax(x), x.argmax(dim=-1))


def test_callers_give_torch_s_tokens(enabled):
    """The sampling paths that now take the kernel: greedy one-hot, exponential race and
    the rejection sampler's greedy tokens."""
    from specmoe.sample import ops
    from specmoe.sample.rejection_sampler import rejection_sample
    from specmoe.sampling_params import SamplingParams
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 500, generator=g)
    draft = logits[:, :2].argmax(-1)
    draft[1, 0] = (draft[1, 0] + 1) % 500  # a rejection at position 0
    st = ops.SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 4, "cpu")
    out = rejection_sample(logits, draft, None, st, [None] * 4)
    want = logits.argmax(-1)
    assert out.num_accepted.tolist() == [2, 0, 2, 2]
    assert out.output_token_ids[:, 0].tolist() == want[:, 0].tolist()
    probs = ops.compute_probs(logits[:, 0], st)
    assert torch.equal(probs.argmax(-1), want[:, 0]) and torch.equal(probs.sum(-1), torch.ones(4))
    p, e = torch.rand(6, 300, generator=g), torch.rand(6, 300, generator=g) + 0.1
    assert torch.equal(ops.exponential_race(p, e), (p / e).argmax(dim=-1))


def test_falls_back_to_torch_where_it_does_not_apply(enabled):
    x = torch.randn(4, 40)
    assert try_argmax(x.bfloat16()) is None
    assert try_argmax(x.double()) is None
    assert try_argmax(torch._neg_view(x)) is None  # lazily negated
    assert try_argmax(x[:, ::2]) is None             # strided inside rows
    assert try_argmax(torch.randn(2, 3, 8)[:, 1:]) is None  # 3-D non-contiguous
    assert try_argmax(torch.randn(3, 0)) is None
    assert try_argmax(torch.tensor(1.0)) is None
    assert try_argmax(x.requires_grad_()) is None
    kernels.set_enabled(False)
    assert try_argmax(torch.randn(4, 40)) is None
    y = torch.randn(2, 3, 8)[:, 1:]
    assert torch.equal(argmax(y), y.argmax(dim=-1))  # the helper takes torch's path
