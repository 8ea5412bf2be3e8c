"""Routing sources for synthetic-weight MoE models, and the unique experts they touch.

A routing source gives, for one MoE layer, the top-k expert ids of `num_seqs` sequences of
`num_tokens` consecutive tokens each: an int64 array [num_seqs, num_tokens, top_k] of distinct
ids per token. Three sources:

- `UniformRouting`: every token an independent uniform k-subset of the N experts (what a
  random router gives, and the "uniform" independence baseline);
- `CorrelatedRouting`: a Markov chain per sequence whose adjacent tokens share, in
  expectation, a chosen fraction of their experts (for example 0.381, the adjacent-token
  overlap measured for k=8, N=128 in the source analysis summarised in docs/architecture.md);
- `TraceRouting`: windows of consecutive tokens replayed from a captured routing trace.

`expected_unique_experts` gives the mean number of distinct experts a step of B sequences x T
tokens touches: the closed form N(1 - (1 - k/N)^(BT)) for uniform routing, a Monte Carlo mean
for the others. This is the expert union a grouped MoE forward reads (MoESD, Huang et al. 2025,
arXiv 2505.19645, section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _check_shape(num_experts: int, top_k: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"invalid top_k={top_k} for num_experts={num_experts}: need "
                         "1 <= top_k <= num_experts")


def _random_subsets(rng: np.random.Generator, shape: tuple[int, ...], num_experts: int,
                    top_k: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """Uniform random k-subsets: [*shape, top_k] int64 distinct ids per row, avoiding the
    ids in `exclude` [*shape, m] when given."""
    scores = rng.random((*shape, num_experts))
    if exclude is not None:
        np.put_along_axis(scores, exclude, -1.0, axis=-1)
    return np.argsort(-scores, axis=-1)[..., :top_k].astype(np.int64)


@dataclass(frozen=True)
class UniformRouting:
    """Independent uniform routing: each token's k experts are a uniform random k-subset."""

    num_experts: int
    top_k: int
    name: str = "uniform"

    def __post_init__(self) -> None:
        _check_shape(self.num_experts, self.top_k)

    def sample(self, num_seqs: int, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
        """[num_seqs, num_tokens, top_k] int64 expert ids."""
        return _random_subsets(rng, (num_seqs, num_tokens), self.num_experts, self.top_k)


@dataclass(frozen=True)
class CorrelatedRouting:
    """Routing with a chosen adjacent-token overlap `overlap` = E|E_t ∩ E_t+1| / k.

    Token 0 of a sequence is a uniform k-subset. Token t+1 keeps each of token t's experts
    independently with probability `overlap` and fills its other slots with experts drawn
    uniformly from those token t did not use. The kept count is Binomial(k, overlap), so
    the expected overlap is exactly `overlap`, and every token's marginal is uniform (so the
    uniform baseline is the independent reference). Needs N >= 2k.

    Raises:
        ValueError: overlap outside [0, 1] or N < 2k.
    """

    num_experts: int
    top_k: int
    overlap: float
    name: str = "correlated"

    def __post_init__(self) -> None:
        _check_shape(self.num_experts, self.top_k)
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"invalid overlap={self.overlap}: must be in [0, 1]")
        if self.num_experts < 2 * self.top_k:
            raise ValueError(f"correlated routing needs num_experts >= 2 * top_k, got "
                             f"num_experts={self.num_experts}, top_k={self.top_k}")

    def sample(self, num_seqs: int, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
        """[num_seqs, num_tokens, top_k] int64 expert ids."""
        out = np.empty((num_seqs, num_tokens, self.top_k), dtype=np.int64)
        out[:, 0] = _random_subsets(rng, (num_seqs,), self.num_experts, self.top_k)
        for t in range(1, num_tokens):
            prev = out[:, t - 1]                                       # [S, k]
            keep = rng.random(prev.shape) < self.overlap               # [S, k]
            fresh = _random_subsets(rng, (num_seqs,), self.num_experts, self.top_k,
                                    exclude=prev)                      # [S, k], none in prev
            slot = np.cumsum(~keep, axis=1) - 1                        # index into fresh
            out[:, t] = np.where(keep, prev, np.take_along_axis(fresh, slot.clip(0), 1))
        return out


class TraceRouting:
    """Replays windows of a captured routing trace.

    Args:
        sequences: per sequence an int64 array [num_layers, num_tokens, top_k] of expert ids
            in position order (the trace's tokens that are part of the sequence).
        num_experts: N of the traced model.
        layer: which traced MoE layer to replay (model layer i replays `layer`; use
            `for_layer` to get one source per layer).

    Raises:
        ValueError: no sequences, mismatched k, or ids outside [0, N).
    """

    name = "trace"

    def __init__(self, sequences: list[np.ndarray], num_experts: int, layer: int = 0) -> None:
        if not sequences:
            raise ValueError("a trace routing source needs at least one sequence")
        self.top_k = int(sequences[0].shape[-1])
        for i, s in enumerate(sequences):
            if s.ndim != 3 or s.shape[-1] != self.top_k:
                raise ValueError(f"trace sequence {i}: shape {s.shape}, expected "
                                 f"[num_layers, num_tokens, {self.top_k}]")
            if s.size and (s.min() < 0 or s.max() >= num_experts):
                raise ValueError(f"trace sequence {i}: expert id outside [0, {num_experts})")
        self.sequences = sequences
        self.num_experts = num_experts
        self.num_layers = int(sequences[0].shape[0])
        self.layer = layer % self.num_layers

    @classmethod
    def from_trace(cls, trace, layer: int = 0) -> "TraceRouting":
        """Replay a `RoutingTrace`: its runs of consecutive on-sequence positions (prefill,
        decode and accepted rows; `routing_stats.sequence_runs`)."""
        from specmoe.analysis.routing_stats import sequence_runs
        runs = [r.transpose(1, 0, 2) for r in sequence_runs(trace) if len(r)]  # [L, n, k]
        if not runs:
            raise ValueError("the routing trace has no prefill, decode or accepted rows to "
                             "replay")
        return cls(runs, trace.num_experts, layer)

    def check_length(self, num_tokens: int, source: str = "the trace") -> None:
        """Raises ValueError when no run of the trace has num_tokens consecutive tokens."""
        longest = max(s.shape[1] for s in self.sequences)
        if longest < num_tokens:
            raise ValueError(f"{source}: its longest run of consecutive tokens has {longest}, "
                             f"fewer than the {num_tokens} a forward of the grid needs")

    def for_layer(self, layer: int) -> "TraceRouting":
        """The same trace replaying traced layer `layer % num_layers`."""
        return TraceRouting(self.sequences, self.num_experts, layer)

    def sample(self, num_seqs: int, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
        """[num_seqs, num_tokens, top_k]: windows at random sequences and start positions.

        Raises:
            ValueError: when no traced sequence has num_tokens tokens.
        """
        long_enough = [s for s in self.sequences if s.shape[1] >= num_tokens]
        if not long_enough:
            raise ValueError(f"no traced sequence has {num_tokens} tokens")
        out = np.empty((num_seqs, num_tokens, self.top_k), dtype=np.int64)
        for b in range(num_seqs):
            s = long_enough[rng.integers(len(long_enough))]
            start = rng.integers(s.shape[1] - num_tokens + 1)
            out[b] = s[self.layer, start:start + num_tokens]
        return out


def count_unique(ids: np.ndarray) -> int:
    """Distinct expert ids in an array of any shape."""
    return int(np.unique(ids).size)


def uniform_unique_experts(num_experts: int, top_k: int, num_tokens: float) -> float:
    """N (1 - (1 - k/N)^n): expected distinct experts of n independent uniform tokens."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def expected_unique_experts(source, num_seqs: int, num_tokens: int,
                            rng: np.random.Generator, num_samples: int = 256) -> float:
    """Expected distinct experts one layer reads for num_seqs sequences x num_tokens tokens:
    the closed form for `UniformRouting`, else the mean over `num_samples` draws. A list of
    sources (one per layer) gives the mean over layers."""
    if isinstance(source, list):
        per_layer = max(1, num_samples // len(source))
        return float(np.mean([expected_unique_experts(s, num_seqs, num_tokens, rng, per_layer)
                              for s in source]))
    if isinstance(source, UniformRouting):
        return uniform_unique_experts(source.num_experts, source.top_k, num_seqs * num_tokens)
    return float(np.mean([count_unique(source.sample(num_seqs, num_tokens, rng))
                          for _ in range(num_samples)]))


def mean_adjacent_overlap(ids: np.ndarray, distance: int = 1) -> float:
    """Mean |E_t ∩ E_t+d| / k over a [num_seqs, num_tokens, k] array (d < num_tokens)."""
    a, b = ids[:, :-distance], ids[:, distance:]
    shared = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1)   # [S, T - d]
    return float(shared.mean() / ids.shape[-1])
