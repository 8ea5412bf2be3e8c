"""What a verification window costs a MoE target: the distinct experts it touches, from the
routing overlap between adjacent tokens, measured live on sampled engine steps.

A request verifying t tokens (its last token and t - 1 drafts) routes each to k of N
experts. With adjacent tokens sharing a fraction o of their experts, the window touches
about u(t) = min(N, k + (t - 1) k (1 - o)) distinct experts (each new token brings its
unshared k (1 - o); returns to older experts are ignored, an upper bound that is tight for
the short windows of speculation). Requests route independently of each other, so a batch
of windows t_1..t_B touches U = N (1 - prod_i (1 - u(t_i) / N)) expected experts per layer:
the expert bytes a memory-bound MoE layer reads (the union the study's cost model uses,
`analysis.cost_model`; Huang et al. 2025, MoESD, arXiv 2505.19645, sec. 3).

Measuring o needs the router's choices, which the fused decoder driver does not hand back:
`RoutingSampler` subscribes a recorder to the model's expert-stats hub for one step in
`every` of those that compute two adjacent tokens of a request (a draft window or a prompt
chunk: a step of single-token decodes has no pair to measure) and at most `max_rows` rows,
and measures o over adjacent tokens within each request's rows. A sampled step runs the
blocks as modules, off the fused driver, so its time is left out of the step-time fit
(sampling tiny-moe's single-token steps too cost 2-3% of a run held at K = 0, for nothing),
and the module path costs in proportion to the rows: a sampled 1024-token prefill step of
the 50%-carved Qwen2.5-Coder-1.5B took 7.7 s instead of 4.8 (a sixth of a run at 16
requests).
"""

from __future__ import annotations

import numpy as np
import torch

from specmoe.layers.moe.backends import expert_stats
from specmoe.layers.moe.stats import ExpertStatsRecorder


def window_experts(tokens, num_experts: int, top_k: int, overlap: float):
    """u(t): expected distinct experts of `tokens` adjacent tokens (a number or an array)."""
    t = np.asarray(tokens, dtype=float)
    return np.minimum(num_experts, top_k + np.maximum(t - 1, 0) * top_k * (1 - overlap))


def miss_log(tokens, num_experts: int, top_k: int, overlap: float):
    """log(1 - u(t)/N): the log-probability that a window of t tokens misses one expert."""
    u = window_experts(tokens, num_experts, top_k, overlap)
    return np.log(np.maximum(1.0 - u / num_experts, 1e-12))


def unique_fraction(windows, num_experts: int, top_k: int, overlap: float) -> float:
    """U / N of a batch of windows (tokens per request), in [0, 1]."""
    return float(1.0 - np.exp(miss_log(windows, num_experts, top_k, overlap).sum()))


def segment_overlap(ids: torch.Tensor, segments: list[int]) -> tuple[int, int]:
    """(shared experts, adjacent pairs x k) over adjacent tokens inside each segment.

    Args:
        ids: [sum(segments), k] int64 routing of one MoE layer's forward, rows in order.
        segments: each request's row count, in the forward's order.
    """
    shared = pairs = 0
    start = 0
    k = ids.shape[1]
    for n in segments:
        seg = ids[start:start + n]
        start += n
        if n < 2:
            continue
        same = (seg[1:, :, None] == seg[:-1, None, :]).any(-1)   # [n - 1, k]
        shared += int(same.sum())
        pairs += (n - 1) * k
    return shared, pairs


class RoutingSampler:
    """Measures adjacent-token routing overlap on one engine step in `every` (module
    docstring). `begin()` before the step's forward, `end(segments)` after it; with no
    model (or no MoE block in it) no step is sampled."""

    def __init__(self, model: torch.nn.Module | None, every: int = 64,
                 max_rows: int = 64) -> None:
        self.hub = expert_stats(model) if model is not None else None
        self.blocks = self.hub.blocks if self.hub is not None else []
        self.every, self.max_rows = every, max_rows
        self._steps = 0
        self._recorder: ExpertStatsRecorder | None = None

    @property
    def applies(self) -> bool:
        return bool(self.blocks)

    def begin(self, longest_window: int, rows: int) -> bool:
        """Subscribe a recorder to the model's expert-stats hub if this step is sampled
        (`longest_window`: the most rows any request computes in it, `rows`: all of them;
        steps of one row each, or of more than `max_rows`, are never sampled nor counted);
        True when it is."""
        if not self.blocks or longest_window < 2 or rows > self.max_rows:
            return False
        self._steps += 1
        if self._steps % self.every:
            return False
        self._recorder = ExpertStatsRecorder()
        self.hub.subscribe(self._recorder)
        return True

    def end(self, segments: list[int]) -> float | None:
        """Unsubscribe the step's recorder; the step's overlap (None: not sampled, or no
        request computed two adjacent tokens)."""
        if self._recorder is None:
            return None
        self.hub.unsubscribe(self._recorder)
        routing, self._recorder = self._recorder.routing, None
        shared = pairs = 0
        for per_forward in routing.values():
            ids = per_forward[-1]
            if ids.shape[0] == sum(segments):
                s, p = segment_overlap(ids, segments)
                shared, pairs = shared + s, pairs + p
        return shared / pairs if pairs else None
