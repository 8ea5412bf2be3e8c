"""Neuron grouping for carving: equal-width experts that partition the FFN, a shared expert
of the most often active neurons, and a balanced assignment that keeps every capacity."""

from __future__ import annotations

import pytest
import torch

from specmoe.carve.cluster import (balanced_assign, balanced_kmeans, coactivation_markers,
                                   group_neurons, outlier_neurons, shared_neurons)


def test_balanced_assign_fills_every_bin_exactly_and_follows_similarity():
    torch.manual_seed(0)
    sim = torch.randn(60, 6)
    assign = balanced_assign(sim, 10)
    assert torch.bincount(assign, minlength=6).tolist() == [10] * 6
    # an item whose favourite bin is uncontested gets it
    sim = torch.full((4, 2), -1.0)
    sim[0, 0] = sim[1, 0] = sim[2, 1] = sim[3, 1] = 1.0
    assert balanced_assign(sim, 2).tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="cannot split 7 neurons into 2 experts of 3"):
        balanced_assign(torch.zeros(7, 2), 3)


def test_kmeans_recovers_planted_coactivation_groups():
    """Three groups of 8 neurons, each group firing on its own third of the tokens."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.arange(300) % 3
    markers = (tokens.unsqueeze(1) == torch.arange(24).unsqueeze(0) // 8).float()
    markers = (markers + 0.05 * torch.rand(300, 24, generator=g)).T  # [neurons, tokens]
    assign = balanced_kmeans(markers, 3, 5, g)
    groups = {tuple(sorted((assign == c).nonzero().squeeze(1).tolist())) for c in range(3)}
    assert groups == {tuple(range(8)), tuple(range(8, 16)), tuple(range(16, 24))}


def test_group_neurons_partitions_the_ffn_with_the_busiest_as_shared():
    g = torch.Generator().manual_seed(0)
    energy = torch.rand(200, 48, generator=g)
    energy[:, [5, 17, 30, 41]] += 10.0  # always the heaviest: the shared expert
    shared, routed = group_neurons(energy, num_experts=11, shared_experts=1,
                                   active_fraction=0.25, iterations=3, generator=g)
    assert shared.tolist() == [5, 17, 30, 41]
    assert routed.shape == (11, 4)
    everything = torch.cat([shared, routed.flatten()]).sort().values
    assert everything.tolist() == list(range(48))
    markers = coactivation_markers(energy, 0.25)
    assert markers.sum(1).tolist() == [12] * 200
    assert shared_neurons(markers, 2).tolist() == [5, 17]


def test_a_massive_activation_neuron_joins_the_shared_expert():
    """Neuron 9 fires on one token of 200, a thousand times above any other neuron: by
    frequency it would be routed, as an outlier it is shared (ahead of the busiest)."""
    g = torch.Generator().manual_seed(0)
    energy = torch.rand(200, 48, generator=g)
    energy[:, [5, 17, 30, 41]] += 10.0
    energy[:, 9] = 0.0
    energy[0, 9] = 1000.0
    assert outlier_neurons(energy).tolist() == [9]
    shared, routed = group_neurons(energy, num_experts=11, shared_experts=1,
                                   active_fraction=0.25, iterations=3, generator=g)
    assert 9 in shared.tolist() and 9 not in routed.flatten().tolist()
    assert shared.numel() == 4 and routed.shape == (11, 4)
    assert outlier_neurons(torch.rand(200, 48, generator=g)).numel() == 0
