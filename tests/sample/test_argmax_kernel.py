"""The native argmax of float32 rows is torch.argmax bit for bit, and falls back to it."""

from __future__ import annotations

import pytest
import torch

from specmoe import kernels
from specmoe.kernels import argmax as argmax_kernel
from specmoe.kernels.argmax import argmax, try_argmax


@pytest.fixture
def enabled():
    reason = argmax_kernel._lazy.unavailable_reason()
    if reason is not None:
        pytest.skip(f"native argmax unavailable: {reason}")
    was = kernels.is_enabled()
    kernels.set_enabled(True)
    yield
    kernels.set_enabled(was)


@pytest.mark.parametrize("shape", [(1, 1), (1, 15), (2, 16), (3, 17), (16, 49152), (1, 151936),
                                   (2, 3, 100), (5000, 33)])  # 5000 x 33: two threads
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


def test_strided_rows_of_a_matrix(enabled):
    base = torch.randn(16, 3, 1000, generator=torch.Generator().manual_seed(1))
    rows = base[:, 1]  # 2-D, unit stride inside rows
    assert not rows.is_contiguous()
    assert torch.equal(try_argmax(rows), rows.argmax(dim=-1))


def test_falls_back_to_torch_where_it_does_not_apply(enabled):
    x = torch.randn(4, 40)
    assert try_argmax(x.bfloat16()) is None
    assert try_argmax(x[:, ::2]) is None             # strided inside rows
    assert try_argmax(torch.randn(2, 3, 8)[:, 1:]) is None  # 3-D non-contiguous
    assert try_argmax(torch.randn(3, 0)) is None
    assert try_argmax(torch.tensor(1.0)) is None
    assert try_argmax(x.requires_grad_()) is None
    kernels.set_enabled(False)
    assert try_argmax(torch.randn(4, 40)) is None
    y = torch.randn(2, 3, 8)[:, 1:]
    assert torch.equal(argmax(y), y.argmax(dim=-1))  # the helper takes torch's path
