"""The hindsight ceiling of choosing K per step (`analysis.hindsight`): never slower than
any static K, exact on small cases worked by hand, and the same as `replay` where K is
fixed."""

from __future__ import annotations

import random

import pytest

from specmoe.analysis.hindsight import pair_seconds, single_seconds
from specmoe.analysis.model_card import accepted_runs, replay


def _acceptor(matches: list[bool]):
    """A proposer that fills every slot, right where `matches` is True."""
    runs = accepted_runs(matches)
    return lambda pos, k: (k, min(runs[pos], k))


def _steep(rows: int) -> float:
    return 10.0 + 3.0 * (rows - 1)  # each draft row costs 30% of a step


def test_a_fixed_k_costs_what_replay_counts():
    acc = _acceptor([True, True, False, True] * 6)
    for k in (1, 2, 4):
        seconds, ks = single_seconds(acc, 24, k, lambda rows: 1.0, static=True)
        assert seconds == replay(24, acc, k)["steps"]
        assert set(ks) <= set(range(k + 1))


def test_by_hand_drafts_pay_only_where_they_are_accepted():
    """Positions 1-3 copy (three drafts accepted), then nothing is: with drafts at 30% of a
    step, the best is K = 3 at position 1 (one step for tokens 1-4), then K = 0."""
    acc = _acceptor([False, True, True, True, False, False, False, False])
    seconds, ks = single_seconds(acc, 8, 8, _steep)
    assert ks == [3, 0, 0, 0]
    assert seconds == pytest.approx(_steep(4) + 3 * _steep(1))


@pytest.mark.parametrize("seed", range(5))
def test_hindsight_is_never_slower_than_a_static_k(seed):
    rng = random.Random(seed)
    matches = [rng.random() < 0.6 for _ in range(40)]
    acc = _acceptor(matches)
    best, _ = single_seconds(acc, 40, 8, _steep)
    for k in (0, 1, 2, 4, 8):
        assert best <= single_seconds(acc, 40, k, _steep, static=True)[0] + 1e-9
    acc2 = _acceptor([rng.random() < 0.3 for _ in range(30)])
    step2 = lambda rows: 12.0 + 2.0 * max(rows - 4, 0)  # noqa: E731
    pair = pair_seconds((acc, acc2), (40, 30), 8, step2, _steep)
    for k in (0, 1, 2, 4, 8):
        assert pair <= pair_seconds((acc, acc2), (40, 30), k, step2, _steep, static=True) + 1e-9


def test_two_requests_without_drafts_run_together_then_the_longer_alone():
    acc = _acceptor([False] * 10)
    seconds = pair_seconds((acc, acc), (10, 6), 0, lambda rows: 2.0, lambda rows: 1.0)
    assert seconds == 5 * 2.0 + 4 * 1.0  # positions 1-5 together, 6-9 alone


def test_a_negative_max_k_raises():
    with pytest.raises(ValueError, match="max_k=-1"):
        single_seconds(_acceptor([True]), 1, -1, _steep)
