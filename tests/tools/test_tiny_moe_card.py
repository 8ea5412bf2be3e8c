"""The routing figures of `tools/tiny_moe_card.py` on hand-made routings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import tiny_moe_card as card  # noqa: E402


def test_identical_routing_overlaps_fully_and_never_grows():
    ids = torch.tensor([[0, 1]] * 6)  # [T, k]: every token uses experts 0 and 1
    assert card.adjacent_overlap([ids], num_experts=8, top_k=2) == 1.0
    assert card.unique_experts([ids], num_experts=8, window=4) == 2.0


def test_disjoint_routing_and_windows():
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    assert card.adjacent_overlap([ids], num_experts=8, top_k=2) == 0.0
    assert card.unique_experts([ids], num_experts=8, window=1) == 2.0
    assert card.unique_experts([ids], num_experts=8, window=3) == 6.0
    # windows never cross a forward (each list entry is one sequence)
    assert card.unique_experts([ids[:2], ids[2:]], num_experts=8, window=2) == 4.0


def test_half_overlap_and_load():
    ids = torch.tensor([[0, 1], [1, 2], [2, 3]])
    assert card.adjacent_overlap([ids], num_experts=4, top_k=2) == 0.5
    load = card.expert_load([ids], num_experts=4)  # counts 1, 2, 2, 1
    assert load["max_over_mean"] == pytest.approx(2 / 1.5)
    assert load["min_over_mean"] == pytest.approx(1 / 1.5)
    assert load["num_unused"] == 0


def test_baselines_match_independent_sampling():
    """Popularity-weighted baselines equal the uniform ones under uniform load, and both
    agree with simulated independent uniform routing."""
    num_experts, top_k, num_tokens = 16, 4, 4000
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(num_tokens)])
    fig = card.routing_figures({0: [ids]}, num_experts, top_k)
    layer = fig["layers"][0]
    assert fig["overlap_uniform"] == top_k / num_experts
    assert layer["overlap"] == pytest.approx(fig["overlap_uniform"], abs=0.02)
    assert layer["overlap_popularity"] == pytest.approx(fig["overlap_uniform"], abs=0.01)
    for w in (1, 4, 8):
        uniform = num_experts * (1 - (1 - top_k / num_experts) ** w)
        assert fig["unique_uniform"][w] == pytest.approx(uniform)
        assert layer["unique"][w] == pytest.approx(uniform, rel=0.02)
        assert layer["unique_popularity"][w] == pytest.approx(uniform, rel=0.02)
