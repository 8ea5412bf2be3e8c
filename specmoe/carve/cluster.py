"""Which FFN neurons form which expert: a shared expert of the massive-activation neurons and
the neurons active most often, routed experts of equal width by balanced clustering of the
rest on co-activation.

A neuron i of a SwiGLU FFN adds act_i(x) * W_down[:, i] to the output, so its weight in a
token's output is e_i = |act_i| * ||W_down[:, i]||. Each token marks its `active_fraction`
heaviest neurons; neurons that are marked by the same tokens belong together (the
co-activation markers of MoEfication, Zhang et al. 2022, arXiv 2110.01786, and of CMoE, Pei
et al. 2025, arXiv 2502.04416). The markers are clustered with spherical k-means under equal
cluster sizes, the balanced assignment done greedily in rounds (each unplaced neuron asks for
its most similar cluster with room; a cluster takes its most similar askers), which is
O(I x N) per round where a dense Hungarian solve over I x I is not affordable for I = 8960.
"""

from __future__ import annotations

import torch


def neuron_energy(act: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """act [T, I] float32, w_down [H, I] -> [T, I]: each neuron's share of the output norm."""
    return act.abs() * w_down.norm(dim=0)


def coactivation_markers(energy: torch.Tensor, active_fraction: float) -> torch.Tensor:
    """[T, I] -> [T, I] bool: each token's ceil(fraction x I) heaviest neurons."""
    t, i = energy.shape
    count = max(1, min(i, int(round(active_fraction * i))))
    top = energy.topk(count, dim=1).indices
    return torch.zeros(t, i, dtype=torch.bool).scatter_(1, top, True)


# A neuron whose largest contribution is this many times the median neuron's largest is a
# massive-activation neuron (Sun et al. 2024, arXiv 2402.17762): it fires on a few tokens
# (the first of a text, the attention sink) with outputs orders of magnitude above the rest.
# Its ratio is 100-2400 in layers 1-4 and 26 of Qwen2.5-Coder-1.5B, at most 51 elsewhere.
OUTLIER_RATIO = 100.0


def outlier_neurons(energy: torch.Tensor, ratio: float = OUTLIER_RATIO) -> torch.Tensor:
    """Neurons whose peak energy over the tokens exceeds `ratio` x the median neuron's peak,
    largest first; [n] int64."""
    peak = energy.max(dim=0).values
    order = peak.sort(descending=True, stable=True).indices
    return order[:int((peak > ratio * peak.median()).sum())]


def shared_neurons(markers: torch.Tensor, count: int, first: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The neurons `first` (up to `count` of them), then those marked by the most tokens
    (ties: lower index) up to `count`, sorted; [count].

    A massive-activation neuron is marked by a few tokens only, so frequency alone routes it;
    a router that misses or over-weights it on those tokens errs by more than the whole
    output of every other token (relative error 1.9 after training in layer 26 of
    Qwen2.5-Coder-1.5B), so the callers pass the `outlier_neurons` as `first`.
    """
    freq = markers.float().mean(0)
    if first is not None and first.numel():
        freq[first[:count]] = float("inf")
    order = freq.sort(descending=True, stable=True).indices
    return order[:count].sort().values


def balanced_assign(similarity: torch.Tensor, capacity: int) -> torch.Tensor:
    """Assign each of I items to one of N bins, each bin taking exactly `capacity` items
    (I = N x capacity), greedily on `similarity` [I, N]: in rounds, every unplaced item asks
    the most similar bin that still has room, and each bin keeps its most similar askers.

    Returns:
        [I] int64 bin of each item.
    Raises:
        ValueError: I != N x capacity.
    """
    items, bins = similarity.shape
    if items != bins * capacity:
        raise ValueError(f"cannot split {items} neurons into {bins} experts of {capacity}")
    assign = torch.full((items,), -1, dtype=torch.int64)
    room = torch.full((bins,), capacity, dtype=torch.int64)
    sim = similarity.clone()
    while (assign < 0).any():
        open_bins = room > 0
        sim[:, ~open_bins] = float("-inf")
        free = (assign < 0).nonzero().squeeze(1)
        want = sim[free].argmax(dim=1)
        score = sim[free, want]
        for b in want.unique().tolist():
            askers = (want == b).nonzero().squeeze(1)
            keep = askers[score[askers].argsort(descending=True, stable=True)[:int(room[b])]]
            assign[free[keep]] = b
            room[b] -= keep.numel()
    return assign


def balanced_kmeans(features: torch.Tensor, num_clusters: int, iterations: int,
                    generator: torch.Generator) -> torch.Tensor:
    """Spherical k-means of rows `features` [I, D] into `num_clusters` equal clusters.

    Returns:
        [I] int64 cluster of each row.
    """
    f = torch.nn.functional.normalize(features.float(), dim=1)
    items = f.shape[0]
    centroids = f[torch.randperm(items, generator=generator)[:num_clusters]]
    assign = balanced_assign(f @ centroids.T, items // num_clusters)
    for _ in range(iterations):
        sums = torch.zeros(num_clusters, f.shape[1]).index_add_(0, assign, f)
        centroids = torch.nn.functional.normalize(sums, dim=1)
        new = balanced_assign(f @ centroids.T, items // num_clusters)
        if torch.equal(new, assign):
            break
        assign = new
    return assign


def group_neurons(energy: torch.Tensor, num_experts: int, shared_experts: int,
                  active_fraction: float, iterations: int, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split I neurons into `shared_experts` + `num_experts` groups of I / (S + N).

    Args:
        energy: [T, I] `neuron_energy` on calibration tokens.
    Returns:
        (shared [S x m] neuron indices, routed [N, m] neuron indices per expert), m = I/(S+N).
    Raises:
        ValueError: I not a multiple of S + N.
    """
    i = energy.shape[1]
    total = num_experts + shared_experts
    if i % total:
        raise ValueError(f"intermediate size {i} is not a multiple of {total} experts "
                         f"({shared_experts} shared + {num_experts} routed)")
    width = i // total
    markers = coactivation_markers(energy, active_fraction)
    shared = shared_neurons(markers, shared_experts * width, outlier_neurons(energy))
    rest = torch.ones(i, dtype=torch.bool)
    rest[shared] = False
    rest_idx = rest.nonzero().squeeze(1)
    assign = balanced_kmeans(markers[:, rest_idx].T, num_experts, iterations, generator)
    routed = torch.stack([rest_idx[assign == e] for e in range(num_experts)])
    return shared, routed
