"""Routing sources of the synthetic presets: the correlated generator hits its overlap, the
uniform closed form, trace replay and unique-expert counting."""

from __future__ import annotations

import numpy as np
import pytest

from specmoe.analysis.routing_gen import (CorrelatedRouting, TraceRouting, UniformRouting,
                                          count_unique, expected_unique_experts,
                                          mean_adjacent_overlap, uniform_unique_experts)


def _distinct_per_token(ids: np.ndarray) -> bool:
    flat = ids.reshape(-1, ids.shape[-1])
    return all(len(set(row.tolist())) == ids.shape[-1] for row in flat)


@pytest.mark.parametrize("num_experts,top_k,overlap", [(128, 8, 0.381), (64, 8, 0.6),
                                                       (8, 2, 0.381), (32, 4, 0.0),
                                                       (32, 4, 1.0)])
def test_correlated_routing_hits_its_overlap(num_experts, top_k, overlap):
    rng = np.random.default_rng(0)
    ids = CorrelatedRouting(num_experts, top_k, overlap).sample(3000, 6, rng)
    assert ids.shape == (3000, 6, top_k) and ids.dtype == np.int64
    assert _distinct_per_token(ids)
    assert ids.min() >= 0 and ids.max() < num_experts
    # 15000 adjacent pairs of k Bernoulli(overlap) keeps: standard error < 0.003.
    assert mean_adjacent_overlap(ids) == pytest.approx(overlap, abs=0.012)


def test_correlated_routing_keeps_a_uniform_marginal():
    rng = np.random.default_rng(1)
    ids = CorrelatedRouting(32, 4, 0.5).sample(4000, 8, rng)
    freq = np.bincount(ids.ravel(), minlength=32) / ids[..., 0].size   # per-token inclusion
    assert np.allclose(freq, 4 / 32, atol=0.01)


def test_correlated_routing_rejects_bad_settings():
    with pytest.raises(ValueError, match="overlap=1.5"):
        CorrelatedRouting(64, 8, 1.5)
    with pytest.raises(ValueError, match="num_experts >= 2"):
        CorrelatedRouting(6, 4, 0.3)
    with pytest.raises(ValueError, match="top_k=9"):
        UniformRouting(8, 9)


def test_uniform_unique_experts_closed_form_matches_monte_carlo():
    rng = np.random.default_rng(2)
    source = UniformRouting(64, 8)
    for num_seqs, num_tokens in [(1, 1), (1, 4), (4, 2), (8, 8)]:
        draws = [count_unique(source.sample(num_seqs, num_tokens, rng)) for _ in range(2000)]
        closed = uniform_unique_experts(64, 8, num_seqs * num_tokens)
        assert np.mean(draws) == pytest.approx(closed, rel=0.01)
        assert expected_unique_experts(source, num_seqs, num_tokens, rng) == closed
    assert uniform_unique_experts(128, 8, 1) == pytest.approx(8.0)


def test_correlated_routing_touches_fewer_experts_than_independent():
    rng = np.random.default_rng(3)
    corr = expected_unique_experts(CorrelatedRouting(128, 8, 0.381), 1, 4, rng, 2000)
    # Token by token: 8 new, then on average 8 * (1 - 0.381) new per token (a few of them
    # returning to experts of two tokens back), so at most 8 + 3 * 4.95.
    assert corr < 8 + 3 * 8 * (1 - 0.381) + 0.1
    assert corr < uniform_unique_experts(128, 8, 4) - 3


def test_mean_adjacent_overlap_on_a_hand_made_sequence():
    ids = np.array([[[0, 1], [1, 2], [3, 4], [4, 3]]])  # overlaps 1/2, 0, 1
    assert mean_adjacent_overlap(ids) == pytest.approx(0.5)
    assert mean_adjacent_overlap(ids, distance=2) == pytest.approx(0.0)  # {0,1}&{3,4}, {1,2}&{4,3}


def test_trace_routing_replays_windows_of_the_trace():
    seq = np.arange(2 * 10 * 2).reshape(2, 10, 2) % 16          # [layers, tokens, k]
    source = TraceRouting([seq], num_experts=16).for_layer(1)
    rng = np.random.default_rng(4)
    out = source.sample(5, 3, rng)
    assert out.shape == (5, 3, 2)
    windows = {tuple(seq[1, s:s + 3].ravel()) for s in range(8)}
    assert all(tuple(w.ravel()) in windows for w in out)
    with pytest.raises(ValueError, match="no traced sequence has 11 tokens"):
        source.sample(1, 11, rng)


def test_trace_routing_rejects_bad_traces():
    with pytest.raises(ValueError, match="at least one sequence"):
        TraceRouting([], 8)
    with pytest.raises(ValueError, match=r"expert id outside \[0, 8\)"):
        TraceRouting([np.full((1, 3, 2), 8)], 8)
    with pytest.raises(ValueError, match="sequence 1"):
        TraceRouting([np.zeros((1, 3, 2), dtype=np.int64), np.zeros((1, 3, 3), dtype=np.int64)], 8)
