"""Routing analysis of a trace (numpy only): adjacent-token expert overlap, unique experts per
window of consecutive tokens against two independence baselines, and expert load imbalance.

Why these figures: a verification window of W = K + 1 consecutive tokens reads the weights of
the *union* of the experts its tokens route to, so its cost follows the unique experts per
window, which adjacent-token overlap makes smaller than independence predicts (the analysis
summarised in docs/architecture.md: overlap 0.381 for k=8, N=128; 20.36 unique experts for 4 tokens;
MoESD, Huang et al. 2025, arXiv 2505.19645, models activated experts under uniform routing).

Windows and pairs are taken within runs of consecutive positions of one sequence, over the
rows of the selected phases (default: the tokens on the sequence: prefill, decode, accepted);
where a position has several selected rows, a non-rejected row wins over a rejected one, and
then the last one in the trace.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specmoe.analysis.routing_trace import PHASES, SEQUENCE_PHASES, RoutingTrace


@dataclass(slots=True)
class RoutingAnalysis:
    """Routing statistics of a trace (D = max_distance, W = max_window, L MoE layers).

    Per-layer arrays have a trailing L axis; `*_mean` is their mean over layers. Entries
    without data (no pair at that distance, no window of that size) are NaN.

    Attributes:
        num_experts, top_k, moe_layers, model: from the trace.
        phases: the phases analysed.
        num_sequences: sequences with at least one analysed token.
        num_tokens: analysed tokens (one per sequence position).
        overlap: [D, L] mean |E_t ∩ E_{t+d}| / k for d = 1..D.
        overlap_mean: [D].
        num_pairs: [D] token pairs (t, t+d) measured.
        overlap_uniform: k / N, the expected overlap of independent uniform routing.
        overlap_popularity: [L] sum_e q_e^2 / k, the expected overlap of independent tokens
            with the measured expert frequencies q.
        unique: [W, L] mean unique experts in a window of w = 1..W consecutive tokens.
        unique_mean: [W].
        num_windows: [W] windows measured (sliding, stride 1).
        unique_uniform: [W] N (1 - (1 - k/N)^w).
        unique_popularity: [W, L] sum_e [1 - (1 - q_e)^w].
        unique_popularity_mean: [W].
        expert_frequency: [L, N] q_e, the fraction of tokens whose top-k includes expert e.
        expert_load: [L, N] int64 tokens routed to each expert.
        load_max_over_mean: [L] max_e load / mean_e load.
        load_cv: [L] coefficient of variation of the load (population std / mean).
    """

    num_experts: int
    top_k: int
    moe_layers: list[int]
    model: str | None
    phases: list[str]
    num_sequences: int
    num_tokens: int
    overlap: np.ndarray
    overlap_mean: np.ndarray
    num_pairs: np.ndarray
    overlap_uniform: float
    overlap_popularity: np.ndarray
    unique: np.ndarray
    unique_mean: np.ndarray
    num_windows: np.ndarray
    unique_uniform: np.ndarray
    unique_popularity: np.ndarray
    unique_popularity_mean: np.ndarray
    expert_frequency: np.ndarray
    expert_load: np.ndarray
    load_max_over_mean: np.ndarray
    load_cv: np.ndarray

    @property
    def distances(self) -> list[int]:
        return list(range(1, len(self.overlap_mean) + 1))

    @property
    def windows(self) -> list[int]:
        return list(range(1, len(self.unique_mean) + 1))

    def to_json(self) -> dict:
        """A JSON-ready dict (NaN becomes null), both baselines labelled."""
        layers = lambda a: {str(layer): _list(a[..., i])  # noqa: E731
                            for i, layer in enumerate(self.moe_layers)}
        k, n = self.top_k, self.num_experts
        return {
            "schema": "specmoe.routing_analysis/1", "model": self.model,
            "num_experts": n, "top_k": k, "moe_layers": list(self.moe_layers),
            "phases": list(self.phases), "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "overlap": {"distances": self.distances, "mean": _list(self.overlap_mean),
                        "per_layer": layers(self.overlap), "num_pairs": _list(self.num_pairs),
                        "baseline_uniform": {"formula": "k/N", "value": self.overlap_uniform},
                        "baseline_popularity": {
                            "formula": "sum_e q_e^2 / k",
                            "mean": _float(self.overlap_popularity.mean()),
                            "per_layer": layers(self.overlap_popularity)}},
            "unique_experts": {
                "windows": self.windows, "mean": _list(self.unique_mean),
                "per_layer": layers(self.unique), "num_windows": _list(self.num_windows),
                "baseline_uniform": {"formula": "N(1 - (1 - k/N)^W)",
                                     "mean": _list(self.unique_uniform)},
                "baseline_popularity": {"formula": "sum_e [1 - (1 - q_e)^W]",
                                        "mean": _list(self.unique_popularity_mean),
                                        "per_layer": layers(self.unique_popularity)}},
            "expert_load": {"max_over_mean": layers(self.load_max_over_mean),
                            "cv": layers(self.load_cv),
                            "max_over_mean_mean": _float(self.load_max_over_mean.mean()),
                            "cv_mean": _float(self.load_cv.mean()),
                            "tokens_per_expert": layers(self.expert_load.T)},
        }


def analyze_routing(trace: RoutingTrace, max_distance: int = 8, max_window: int = 8,
                    phases: Sequence[str] = SEQUENCE_PHASES) -> RoutingAnalysis:
    """Overlap, unique experts with both baselines, and load imbalance of `trace`.

    Args:
        trace: the routing trace.
        max_distance: D, overlap measured for d = 1..D.
        max_window: W, unique experts measured for windows of 1..W tokens.
        phases: which rows make up the sequences (see the module docstring).
    Raises:
        ValueError: D or W below 1, an unknown phase, or no row of the selected phases.
    """
    _check_args(max_distance, max_window, phases)
    rows = _selected_rows(trace, phases)
    runs = _split_runs(trace, rows)
    if not runs:
        raise ValueError(f"the trace has no rows of phases {list(phases)} (it has "
                         f"{trace.phase_counts()})")
    n, k = trace.num_experts, trace.top_k
    onehots = [expert_onehot(r, n) for r in runs]
    overlap, num_pairs = adjacent_overlap(onehots, k, max_distance)
    unique, num_windows = unique_experts(onehots, max_window)
    load = sum(oh.sum(axis=0, dtype=np.int64) for oh in onehots)  # [L, N]
    num_tokens = sum(len(r) for r in runs)
    freq = load / num_tokens
    popularity = popularity_baseline(freq, max_window)
    max_over_mean, cv = load_imbalance(load)
    return RoutingAnalysis(
        n, k, list(trace.moe_layers), trace.model, list(phases),
        len(rows), num_tokens, overlap,
        overlap.mean(axis=-1), num_pairs, k / n, (freq ** 2).sum(axis=1) / k, unique,
        unique.mean(axis=-1), num_windows, uniform_baseline(n, k, max_window), popularity,
        popularity.mean(axis=1), freq, load, max_over_mean, cv)


def _check_args(max_distance: int, max_window: int, phases: Sequence[str]) -> None:
    if max_distance < 1:
        raise ValueError(f"invalid max_distance={max_distance}: must be >= 1")
    if max_window < 1:
        raise ValueError(f"invalid max_window={max_window}: must be >= 1")
    if not phases:
        raise ValueError(f"no phases selected: choose from {PHASES}")
    bad = [p for p in phases if p not in PHASES]
    if bad:
        raise ValueError(f"unknown phase {bad[0]!r}: choose from {PHASES}")


def sequence_runs(trace: RoutingTrace, phases: Sequence[str] = SEQUENCE_PHASES
                  ) -> list[np.ndarray]:
    """The selected rows as runs of consecutive positions: a list of [n, L, k] expert-id
    arrays, each run in position order, sequences in order of first appearance.

    Where a (sequence, position) has several selected rows, a non-rejected row wins over a
    rejected one, then the later row.
    """
    return _split_runs(trace, _selected_rows(trace, phases))


def _split_runs(trace: RoutingTrace, rows: dict[str, np.ndarray]) -> list[np.ndarray]:
    runs = []
    for seq_rows in rows.values():
        pos = trace.pos[seq_rows]
        breaks = np.flatnonzero(np.diff(pos) != 1) + 1
        runs.extend(trace.experts[r] for r in np.split(seq_rows, breaks))
    return runs


def _selected_rows(trace: RoutingTrace, phases: Sequence[str]) -> dict[str, np.ndarray]:
    """Per sequence, the row indices kept (one per position), in position order."""
    chosen: dict[tuple[str, int], int] = {}
    rank: dict[tuple[str, int], bool] = {}
    selected = np.isin(trace.phase, list(phases))
    is_rejected = trace.phase == "rejected"
    for i in np.flatnonzero(selected).tolist():
        key = (trace.seq[i], int(trace.pos[i]))
        better = not is_rejected[i]
        if key not in chosen or better or not rank[key]:
            chosen[key], rank[key] = i, better
    rows: dict[str, list[tuple[int, int]]] = {}
    for (seq, pos), i in chosen.items():
        rows.setdefault(seq, []).append((pos, i))
    return {seq: np.array([i for _, i in sorted(v)], np.int64) for seq, v in rows.items()}


def expert_onehot(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """experts [n, L, k] ids -> [n, L, N] bool membership."""
    onehot = np.zeros((*experts.shape[:2], num_experts), dtype=bool)
    np.put_along_axis(onehot, experts, True, axis=2)
    return onehot


def adjacent_overlap(onehots: Sequence[np.ndarray], top_k: int, max_distance: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Mean |E_t ∩ E_{t+d}| / k over all pairs within runs, for d = 1..D.

    Args:
        onehots: runs of [n, L, N] bool expert membership.
    Returns:
        overlap [D, L] (NaN where no pair), num_pairs [D] int64.
    """
    num_layers = onehots[0].shape[1]
    shared = np.zeros((max_distance, num_layers))
    num_pairs = np.zeros(max_distance, np.int64)
    for oh in onehots:
        for d in range(1, min(max_distance, len(oh) - 1) + 1):
            shared[d - 1] += (oh[:-d] & oh[d:]).sum(axis=(0, 2))
            num_pairs[d - 1] += len(oh) - d
    return _safe_div(shared, num_pairs[:, None] * top_k), num_pairs


def unique_experts(onehots: Sequence[np.ndarray], max_window: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Mean number of distinct experts in windows of w = 1..W consecutive tokens (all
    windows of each run, stride 1).

    Returns:
        unique [W, L] (NaN where no window), num_windows [W] int64.
    """
    num_layers = onehots[0].shape[1]
    total = np.zeros((max_window, num_layers))
    num_windows = np.zeros(max_window, np.int64)
    for oh in onehots:
        counts = np.concatenate([np.zeros((1, *oh.shape[1:]), np.int32),
                                 np.cumsum(oh, axis=0, dtype=np.int32)])  # [n + 1, L, N]
        for w in range(1, min(max_window, len(oh)) + 1):
            in_window = (counts[w:] - counts[:-w]) > 0  # [n - w + 1, L, N]
            total[w - 1] += in_window.sum(axis=(0, 2))
            num_windows[w - 1] += len(oh) - w + 1
    return _safe_div(total, num_windows[:, None]), num_windows


def uniform_baseline(num_experts: int, top_k: int, max_window: int) -> np.ndarray:
    """[W] expected unique experts of w = 1..W independent tokens, each routed to k experts
    drawn uniformly without replacement: N (1 - (1 - k/N)^w) (the uniform-routing model of
    MoESD, arXiv 2505.19645)."""
    w = np.arange(1, max_window + 1)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** w)


def popularity_baseline(expert_frequency: np.ndarray, max_window: int) -> np.ndarray:
    """[W, L] expected unique experts of w = 1..W tokens drawn independently from the measured
    routing: sum_e [1 - (1 - q_e)^w], exact under token independence whatever the
    correlations within one token's top-k (expert e is missed by all w tokens with
    probability (1 - q_e)^w).

    Args:
        expert_frequency: [L, N] q_e, fraction of tokens whose top-k includes e (sums to k).
    """
    w = np.arange(1, max_window + 1)[:, None, None]  # [W, 1, 1]
    return (1.0 - (1.0 - expert_frequency[None]) ** w).sum(axis=2)


def load_imbalance(load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """load [L, N] tokens per expert -> (max/mean [L], coefficient of variation [L]);
    NaN for a layer without tokens."""
    mean = load.mean(axis=1)
    return _safe_div(load.max(axis=1), mean), _safe_div(load.std(axis=1), mean)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num, den = np.asarray(num, float), np.broadcast_to(np.asarray(den, float), np.shape(num))
    out = np.full(np.shape(num), np.nan)
    np.divide(num, den, out=out, where=den > 0)
    return out


def _float(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def _list(a: np.ndarray) -> list | float | int | None:
    """JSON-ready values of `a` (a scalar for a 0-d array), NaN as None."""
    values = np.asarray(a).tolist()
    if not isinstance(values, list):
        return _float(values) if isinstance(values, float) else values
    return [_float(x) if isinstance(x, float) else x for x in values]
