"""Adaptive speculation (`SpeculativeConfig.policy = "adaptive"`): before each step, every
running request's K in 0..its own K is chosen to maximise the batch's expected tokens per
second.

- Acceptance: per request and draft position, the rate at which a reached draft is accepted,
  shrunk towards the engine-wide rate by `prior_strength` pseudo-drafts (a Beta-binomial
  estimate), so that a new request starts at the engine's rate and moves to its own as it
  drafts. The j-th draft adds prod_{i<=j} a_i expected tokens, so K drafts give
  1 + sum_{j<K} prod_{i<=j} a_i (Leviathan et al. 2023, arXiv 2211.17192, eq. 1, with
  position-dependent rates).
- Step time: the target forward's seconds as a convex, increasing, piecewise-linear function
  of its rows (the tokens it computes): c0 + c1 r + sum_j c_j max(0, r - knot_j), all c >= 0,
  fitted online by non-negative least squares (relative error) on the recent steps' timings.
  Few rows cost little more than one (the weights are read once: memory-bound), many rows
  cost in proportion (compute-bound); the hinges let prefill chunks calibrate the second
  regime without making a few draft rows look expensive. Drafting costs d x depth (the
  deepest request's K: a draft model runs the batch that many times), d the measured
  drafting seconds per depth, averaged.
- Choice: for a given draft depth D and number n of drafts, the best drafts are the n with
  the most expected tokens (each request's are non-increasing in position, so they are a
  prefix of each request's); the best n maximises tokens / seconds. Each D = 0..K_max is
  tried, and the best kept.
- Hysteresis: the previous step's Ks stay unless the new choice is predicted `hysteresis`
  faster. Re-probing: a request held at K = 0 drafts one token every `probe_every` steps, so
  its acceptance estimate stays current and speculation returns where it would pay.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AdaptiveSettings:
    """max_k: the largest K any request may draft; the rest: see the module docstring
    (window: steps the time model is fitted on; min_fit_steps: steps before it is used, the
    requests' own K until then)."""

    max_k: int
    prior_strength: float = 4.0
    hysteresis: float = 0.03
    probe_every: int = 16
    window: int = 256
    min_fit_steps: int = 8


class AcceptanceTracker:
    """Draft acceptance per position, engine-wide and per request."""

    def __init__(self, max_k: int, prior_strength: float) -> None:
        self.max_k, self.prior_strength = max_k, prior_strength
        self.engine = np.zeros((2, max_k))  # [reached, accepted] per position
        self._requests: dict[str, np.ndarray] = {}

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts of which the first `accepted` were accepted:
        positions 0..accepted were reached (the first rejection included)."""
        drafted = min(drafted, self.max_k)
        if drafted <= 0:
            return
        counts = np.zeros((2, self.max_k))
        counts[0, :min(accepted + 1, drafted)] = 1
        counts[1, :min(accepted, drafted)] = 1
        self.engine += counts
        self._requests.setdefault(request_id, np.zeros((2, self.max_k)))
        self._requests[request_id] += counts

    def rates(self, request_id: str) -> np.ndarray:
        """[max_k] estimated acceptance rate of a reached draft at each position."""
        prior = (self.engine[1] + 1) / (self.engine[0] + 2)
        own = self._requests.get(request_id)
        if own is None:
            return prior
        s = self.prior_strength
        return (own[1] + s * prior) / (own[0] + s)

    def gains(self, request_id: str) -> np.ndarray:
        """[max_k] expected tokens the j-th draft adds: prod_{i<=j} rates."""
        return np.cumprod(self.rates(request_id))

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


KNOTS = (8, 32, 128)  # rows where the step time's slope may grow


def _row_features(rows) -> np.ndarray:
    r = np.asarray(rows, dtype=float)
    return np.stack([np.ones_like(r), r, *(np.maximum(r - k, 0.0) for k in KNOTS)], axis=-1)


class StepTimeModel:
    """Target forward seconds as a convex increasing piecewise-linear function of rows (module
    docstring), non-negative least squares on a window of steps."""

    def __init__(self, window: int, min_steps: int) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self.min_steps = min_steps
        self.coef: np.ndarray | None = None

    def observe(self, rows: int, seconds: float) -> None:
        self._steps.append((rows, seconds))
        if len(self._steps) >= self.min_steps and len(self._steps) % 4 == 0:
            self._fit()

    def _fit(self) -> None:
        from scipy.optimize import nnls
        rows, secs = np.array(self._steps, dtype=float).T
        # relative error: a long prefill step must not outweigh a hundred decode steps
        self.coef, _ = nnls(_row_features(rows) / secs[:, None], np.ones_like(secs))

    def predict(self, rows):
        """Seconds at `rows` (a number or an array); None before the first fit."""
        return None if self.coef is None else _row_features(rows) @ self.coef


def choose_ks(gains: np.ndarray, caps: np.ndarray, step_s, draft_s: float
              ) -> tuple[np.ndarray, float]:
    """The K per request that maximises expected tokens per second (module docstring).

    Args:
        gains: [B, max_k] expected tokens of each request's j-th draft, non-increasing in j.
        caps: [B] int, each request's largest K.
        step_s: the target step's seconds as a function of its draft count (an array of
            counts -> an array of seconds), non-decreasing.
        draft_s: drafting seconds per depth.
    Returns:
        (ks [B] int64, the predicted tokens per second).
    """
    b, max_k = gains.shape
    best_ks, best_rate = np.zeros(b, dtype=np.int64), b / float(step_s(np.zeros(1))[0])
    for depth in range(1, min(max_k, int(caps.max(initial=0))) + 1):
        g = np.where(np.arange(depth)[None, :] < caps[:, None], gains[:, :depth], -np.inf)
        order = np.argsort(-g, axis=None, kind="stable")
        vals = g.reshape(-1)[order]
        vals = vals[np.isfinite(vals)]
        tokens = b + np.concatenate([[0.0], np.cumsum(vals)])
        seconds = step_s(np.arange(vals.size + 1)) + draft_s * depth
        n = int(np.argmax(tokens / seconds))
        rate = tokens[n] / seconds[n]
        if n and rate > best_rate:
            best_rate = rate
            best_ks = np.bincount(order[:n] // depth, minlength=b)
    return best_ks, float(best_rate)


def predicted_rate(ks: np.ndarray, gains: np.ndarray, step_s, draft_s: float) -> float:
    """Expected tokens per second of the batch at `ks` (`choose_ks`'s arguments)."""
    tokens = len(ks) + sum(float(g[:k].sum()) for g, k in zip(gains, ks))
    seconds = float(step_s(np.array([int(ks.sum())]))[0]) + draft_s * int(ks.max(initial=0))
    return tokens / seconds


class AdaptivePolicy:
    """Chooses each step's K per request; fed by the engine with what each step verified
    and how long its forward and drafting took."""

    def __init__(self, settings: AdaptiveSettings) -> None:
        self.s = settings
        self.acceptance = AcceptanceTracker(settings.max_k, settings.prior_strength)
        self.step_time = StepTimeModel(settings.window, settings.min_fit_steps)
        self.draft_s = 0.0
        self._draft_obs = 0
        self._previous: dict[str, int] = {}
        self._idle: dict[str, int] = {}  # consecutive steps at K = 0
        self.predicted_step_s: float | None = None

    def observe_verified(self, request_id: str, drafted: int, accepted: int) -> None:
        self.acceptance.observe(request_id, drafted, accepted)

    def observe_step(self, rows: int, seconds: float) -> float | None:
        """Record the forward's time; returns the relative error of its prediction (None:
        nothing was predicted)."""
        error = None
        if self.predicted_step_s:
            error = abs(self.predicted_step_s - seconds) / seconds
        self.step_time.observe(rows, seconds)
        self.predicted_step_s = None
        return error

    def observe_draft(self, depth: int, seconds: float) -> None:
        if depth > 0:
            self._draft_obs += 1
            weight = max(1.0 / self._draft_obs, 0.1)  # mean, then a moving average
            self.draft_s += weight * (seconds / depth - self.draft_s)

    def choose(self, request_ids: list[str], caps: list[int], base_rows: int
               ) -> dict[str, int]:
        """K per request (at most its cap) for the next step; `base_rows`: the rows the
        step computes without drafts (the predicted time adds one per draft)."""
        if not request_ids:
            return {}
        caps_a = np.minimum(np.asarray(caps, dtype=np.int64), self.s.max_k)
        if self.step_time.coef is None:  # not calibrated yet: the requests' own K
            return dict(zip(request_ids, caps_a.tolist()))
        def step_s(drafts: np.ndarray) -> np.ndarray:
            return self.step_time.predict(base_rows + drafts)

        gains = np.stack([self.acceptance.gains(r) for r in request_ids])
        ks, rate = choose_ks(gains, caps_a, step_s, self.draft_s)
        prev = np.array([min(self._previous.get(r, k), c) for r, k, c
                         in zip(request_ids, ks, caps_a)], dtype=np.int64)
        if rate <= predicted_rate(prev, gains, step_s, self.draft_s) * (1 + self.s.hysteresis):
            ks = prev
        ks = self._probe(request_ids, ks, caps_a)
        self.predicted_step_s = float(step_s(np.array([int(ks.sum())]))[0])
        self._previous = dict(zip(request_ids, ks.tolist()))
        return dict(self._previous)

    def _probe(self, request_ids: list[str], ks: np.ndarray, caps: np.ndarray) -> np.ndarray:
        ks = ks.copy()
        for i, r in enumerate(request_ids):
            idle = self._idle.get(r, 0) + 1 if ks[i] == 0 else 0
            if idle >= self.s.probe_every and caps[i] > 0:
                ks[i], idle = 1, 0
            self._idle[r] = idle
        return ks

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self._previous.pop(request_id, None)
        self._idle.pop(request_id, None)
