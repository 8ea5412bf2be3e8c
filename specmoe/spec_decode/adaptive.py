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
  regime without making a few draft rows look expensive. On a MoE target one more term,
  c_U U/N: the share of experts the step's windows touch (`routing_overlap`: expected from
  the adjacent-token overlap measured live on sampled steps), since a memory-bound MoE layer
  reads each touched expert once, so K drafts of one request cost about the experts they
  add, not K rows. Drafting costs d x depth (the deepest request's K: a draft model runs
  the batch that many times), d the measured drafting seconds per depth, averaged.
- Choice: for a given draft depth D and number n of drafts, the best drafts are the n with
  the most expected tokens (each request's are non-increasing in position, so they are a
  prefix of each request's); the best n maximises tokens / seconds. Each D = 0..K_max is
  tried, and the best kept.
- Hysteresis: the previous step's Ks stay unless the new choice is predicted `hysteresis`
  faster. Re-probing: after `probe_every` steps in which some request is held at K = 0, all
  such requests draft one token on the same step, so their acceptance estimates stay
  current and speculation returns where it would pay; probing them together runs the draft
  model once for the batch (a draft model must first catch up on the request's tokens, so
  staggered probes would run it on nearly every step). A probe costs a draft catch-up, a
  few target steps' worth on a small target, so each probe after which the batch stays off
  doubles the interval, up to `probe_every_max` steps; a solve that turns speculation on
  resets it (exponential backoff, as for retries).
- Speculation off: once the choice is K = 0 for every request, the same batch keeps K = 0
  (probes aside) without re-solving until a probe's results are in, the batch changes or
  `recheck_every` steps have passed (nothing else informs the choice while no request
  drafts, and on a small model a solve costs a step's tenth). The step-time model is
  refitted only when a solve needs it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from specmoe.spec_decode.routing_overlap import miss_log, unique_fraction


@dataclass(frozen=True)
class AdaptiveSettings:
    """max_k: the largest K any request may draft; the rest: see the module docstring
    (window: steps the time model is fitted on; min_fit_steps: steps before it is used, the
    requests' own K until then)."""

    max_k: int
    prior_strength: float = 4.0
    hysteresis: float = 0.03
    probe_every: int = 16
    probe_every_max: int = 256
    recheck_every: int = 32
    window: int = 256
    min_fit_steps: int = 8
    num_experts: int = 0  # a MoE target's routed experts N and top-k (0: dense)
    top_k: int = 0
    overlap_prior: float = 0.4  # adjacent-token overlap until one is measured

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


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


def _row_features(rows, unique_frac=None) -> np.ndarray:
    r = np.asarray(rows, dtype=float)
    cols = [np.ones_like(r), r, *(np.maximum(r - k, 0.0) for k in KNOTS)]
    if unique_frac is not None:
        cols.append(np.broadcast_to(np.asarray(unique_frac, dtype=float), r.shape))
    return np.stack(cols, axis=-1)


class StepTimeModel:
    """Target forward seconds as a convex increasing piecewise-linear function of rows, plus
    c_U U/N on a MoE target (module docstring), non-negative least squares on a window of
    steps."""

    def __init__(self, window: int, min_steps: int, moe: bool = False) -> None:
        self._steps: deque[tuple[int, float, float]] = deque(maxlen=window)
        self.min_steps = min_steps
        self.moe = moe
        self.coef: np.ndarray | None = None
        self._observed = 0
        self._fitted_at = 0  # steps observed at the last fit
        self._floor = 0.0  # least seconds a prediction may give (set by each fit)

    def observe(self, rows: int, seconds: float, unique_frac: float = 0.0) -> None:
        """Record a step (the first fit as soon as `min_steps` are in; later ones when a
        prediction asks)."""
        self._steps.append((rows, seconds, unique_frac))
        self._observed += 1
        if self.coef is None and len(self._steps) >= self.min_steps:
            self._fit()

    def refresh(self) -> None:
        """Refit if 4 or more steps came in since the last fit."""
        if self.coef is not None and self._observed - self._fitted_at >= 4:
            self._fit()

    def _fit(self) -> None:
        from scipy.optimize import nnls
        rows, secs, frac = np.array(self._steps, dtype=float).T
        feats = _row_features(rows, frac if self.moe else None)
        # relative error: a long prefill step must not outweigh a hundred decode steps
        self.coef, _ = nnls(feats / secs[:, None], np.ones_like(secs))
        self._fitted_at = self._observed
        # a fit on large steps alone may put every weight on the hinges, predicting 0 s
        # for a few rows; no step runs faster than half the fastest one seen
        self._floor = 0.5 * float(secs.min())

    def predict_one(self, rows: int, unique_frac: float = 0.0) -> float | None:
        """`predict` for one step from the last fit, in plain floats (no refit)."""
        c = self.coef
        if c is None:
            return None
        seconds = c[0] + c[1] * rows + sum(
            cj * max(0.0, rows - knot) for cj, knot in zip(c[2:], KNOTS))
        return max(self._floor, float(seconds + (c[-1] * unique_frac if self.moe else 0.0)))

    def predict(self, rows, unique_frac=0.0, refit: bool = True):
        """Seconds at `rows` (a number or an array) and, on a MoE target, the windows'
        share of experts (same shape); None before the first fit. `refit=False` skips
        refitting on the steps observed since the last fit (a cheap, slightly stale
        prediction)."""
        if refit:
            self.refresh()
        if self.coef is None:
            return None
        return np.maximum(_row_features(rows, unique_frac if self.moe else None) @ self.coef,
                          self._floor)


def choose_ks(gains: np.ndarray, caps: np.ndarray, step_s, draft_s: float,
              miss_step: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """The K per request that maximises expected tokens per second (module docstring).

    Args:
        gains: [B, max_k] expected tokens of each request's j-th draft, non-increasing in j.
        caps: [B] int, each request's largest K.
        step_s: the target step's seconds from its draft count and (MoE) the log of the
            share of experts its windows miss (two arrays of one shape -> an array of
            seconds), non-decreasing in both.
        draft_s: drafting seconds per depth.
        miss_step: [max_k + 1], a MoE target's log-miss of a window of 1 + j tokens
            (`routing_overlap.miss_log`); None for a dense target.
    Returns:
        (ks [B] int64, the predicted tokens per second).
    """
    b, max_k = gains.shape
    miss = np.zeros(max_k + 1) if miss_step is None else miss_step
    base_miss = b * miss[0]
    best_ks = np.zeros(b, dtype=np.int64)
    best_rate = b / float(step_s(np.zeros(1), np.full(1, base_miss))[0])
    max_depth = min(max_k, int(caps.max(initial=0)))
    if not _may_pay(gains, caps, b / best_rate, draft_s, max_depth, best_rate):
        return best_ks, float(best_rate)
    for depth in range(1, max_depth + 1):
        g = np.where(np.arange(depth)[None, :] < caps[:, None], gains[:, :depth], -np.inf)
        order = np.argsort(-g, axis=None, kind="stable")
        vals = g.reshape(-1)[order]
        finite = np.isfinite(vals)
        vals, order = vals[finite], order[finite]
        # a request's j-th draft grows its window from j + 1 to j + 2 tokens
        grow = np.diff(miss)[order % depth]
        tokens = b + np.concatenate([[0.0], np.cumsum(vals)])
        misses = base_miss + np.concatenate([[0.0], np.cumsum(grow)])
        seconds = step_s(np.arange(vals.size + 1), misses) + draft_s * depth
        n = int(np.argmax(tokens / seconds))
        rate = tokens[n] / seconds[n]
        if n and rate > best_rate:
            best_rate = rate
            best_ks = np.bincount(order[:n] // depth, minlength=b)
    return best_ks, float(best_rate)


def _may_pay(gains: np.ndarray, caps: np.ndarray, plain_s: float, draft_s: float,
             max_depth: int, plain_rate: float) -> bool:
    """Whether any draft depth could beat no speculation: at depth D at most every
    allowed draft up to D is accepted, and the step costs at least the plain step plus D
    draft steps (the step time does not fall with more rows or experts). A cheap bound
    that skips `choose_ks`'s search on the steps where speculation is hopeless."""
    if max_depth < 1:
        return False
    allowed = np.where(np.arange(gains.shape[1])[None, :] < caps[:, None], gains, 0.0)
    most = gains.shape[0] + np.cumsum(allowed.sum(axis=0))[:max_depth]
    return bool(np.max(most / (plain_s + draft_s * np.arange(1, max_depth + 1))) > plain_rate)


def predicted_rate(ks: np.ndarray, gains: np.ndarray, step_s, draft_s: float,
                   miss_step: np.ndarray | None = None) -> float:
    """Expected tokens per second of the batch at `ks` (`choose_ks`'s arguments)."""
    tokens = len(ks) + sum(float(g[:k].sum()) for g, k in zip(gains, ks))
    return tokens / (_step_seconds(ks, step_s, miss_step) + draft_s * int(ks.max(initial=0)))


def _running_mean(mean: float, count: int, value: float) -> float:
    """The mean of the first values, then a moving average weighting the newest by 0.1;
    `count` includes `value`."""
    return mean + max(1.0 / count, 0.1) * (value - mean)


def _step_seconds(ks: np.ndarray, step_s, miss_step: np.ndarray | None) -> float:
    misses = 0.0 if miss_step is None else float(miss_step[ks].sum())
    return float(step_s(np.array([int(ks.sum())]), np.array([misses]))[0])


class AdaptivePolicy:
    """Chooses each step's K per request; fed by the engine with what each step verified
    and how long its forward and drafting took."""

    def __init__(self, settings: AdaptiveSettings) -> None:
        self.s = settings
        self.acceptance = AcceptanceTracker(settings.max_k, settings.prior_strength)
        self.step_time = StepTimeModel(settings.window, settings.min_fit_steps,
                                       settings.is_moe)
        self.overlap = settings.overlap_prior
        self._overlap_obs = 0
        self.draft_s = 0.0
        self._draft_obs = 0
        self._previous: dict[str, int] = {}
        self._since_probe = 0  # steps with a request held at K = 0 since the last probe
        self.probe_interval = settings.probe_every  # grows while probes find nothing
        self._probed = False  # the previous step probed
        # (overlap, log-miss of windows of 1..max_k + 1 tokens as an array and a list)
        self._miss_cache: tuple[float, np.ndarray, list[float]] | None = None
        self._off: tuple[tuple[str, ...], int] | None = None  # (batch, steps) all at K = 0
        self.predicted_step_s: float | None = None

    def observe_verified(self, request_id: str, drafted: int, accepted: int) -> None:
        self.acceptance.observe(request_id, drafted, accepted)

    def observe_step(self, rows: int, seconds: float, windows: list[int] | None = None
                     ) -> float | None:
        """Record the forward's time (`windows`: the rows of each request in it, for a MoE
        target's expert share); returns the relative error of its prediction (None: nothing
        was predicted)."""
        error = None
        if self.predicted_step_s:
            error = abs(self.predicted_step_s - seconds) / seconds
        self.step_time.observe(rows, seconds, self.unique_fraction(windows or [rows]))
        self.predicted_step_s = None
        return error

    def observe_overlap(self, overlap: float) -> None:
        """An adjacent-token routing overlap measured on a sampled step (MoE targets)."""
        self._overlap_obs += 1
        self.overlap = _running_mean(self.overlap, self._overlap_obs, overlap)

    def unique_fraction(self, windows: list[int]) -> float:
        """U / N of a step's windows on a MoE target (0 on a dense one)."""
        if not self.s.is_moe:
            return 0.0
        self._miss()
        miss = self._miss_cache[2]  # the same log-misses as a list: no numpy per step
        if max(windows) > len(miss):  # a prompt chunk: beyond the cached window lengths
            return unique_fraction(windows, self.s.num_experts, self.s.top_k, self.overlap)
        return 1.0 - math.exp(sum(miss[t - 1] for t in windows))

    def observe_draft(self, depth: int, seconds: float) -> None:
        """A drafting call of `depth` tokens per request that took `seconds`, the draft
        model's catch-up on context it had not seen included: a request that resumes
        after K = 0 pays that catch-up, and a cost from steady calls alone underprices
        resuming (it turns speculation back on where the catch-ups then outweigh the
        gain). A model of the catch-up per request is the better fix (not yet here)."""
        if depth > 0:
            self._draft_obs += 1
            self.draft_s = _running_mean(self.draft_s, self._draft_obs, seconds / depth)

    def choose(self, request_ids: list[str], caps: list[int], base_rows: int
               ) -> dict[str, int]:
        """K per request (at most its cap) for the next step; `base_rows`: the rows the
        step computes without drafts (the predicted time adds one per draft)."""
        if not request_ids:
            return {}
        if self.step_time.coef is None:  # not calibrated yet: the requests' own K
            return {r: min(c, self.s.max_k) for r, c in zip(request_ids, caps)}
        batch, off = tuple(request_ids), self._off
        if (off is not None and off[0] == batch and off[1] < self.s.recheck_every
                and not self._probed):
            # held off: the common step while speculation does not pay, kept to plain
            # Python (a numpy call costs microseconds, a small target's step a millisecond)
            self._off = (batch, off[1] + 1)
            self.predicted_step_s = self._predict_off(base_rows, len(batch))
            return self._keep(request_ids, [0] * len(batch), caps)
        caps_a = np.minimum(np.asarray(caps, dtype=np.int64), self.s.max_k)
        ks = self._solve(request_ids, caps_a, base_rows)
        self._off = (batch, 1) if not ks.any() else None
        self._back_off(bool(ks.any()))
        return self._keep(request_ids, ks.tolist(), caps)

    def _back_off(self, speculating: bool) -> None:
        """Double the probe interval when the solve after a probe keeps every request at
        K = 0; back to `probe_every` once speculation pays."""
        if speculating:
            self.probe_interval = self.s.probe_every
        elif self._probed:
            self.probe_interval = min(2 * self.probe_interval, self.s.probe_every_max)
        self._probed = False

    def _keep(self, request_ids: list[str], ks: list[int], caps: list[int]
              ) -> dict[str, int]:
        """The chosen Ks with this step's probes, remembered for the hysteresis."""
        self._previous = dict(zip(request_ids, self._probe(ks, caps)))
        return dict(self._previous)

    def _solve(self, request_ids: list[str], caps_a: np.ndarray, base_rows: int
               ) -> np.ndarray:
        """The best Ks for the batch (module docstring), with the hysteresis, and the
        predicted step time."""
        step_s, miss = self._step_fn(base_rows), self._miss()
        gains = np.stack([self.acceptance.gains(r) for r in request_ids])
        ks, rate = choose_ks(gains, caps_a, step_s, self.draft_s, miss)
        prev = np.array([min(self._previous.get(r, k), c) for r, k, c
                         in zip(request_ids, ks, caps_a)], dtype=np.int64)
        if rate <= predicted_rate(prev, gains, step_s, self.draft_s, miss) * (
                1 + self.s.hysteresis):
            ks = prev
        self.predicted_step_s = _step_seconds(ks, step_s, miss)
        return ks

    def _predict_off(self, rows: int, batch_size: int) -> float:
        """The forward's seconds with no drafts, from the last fit (cheap: every step)."""
        frac = self.unique_fraction([1] * batch_size) if self.s.is_moe else 0.0
        return self.step_time.predict_one(rows, frac)

    def _step_fn(self, base_rows: int, refit: bool = True):
        """(drafts, log expert misses) -> predicted forward seconds, for a batch whose
        forward computes `base_rows` rows before drafts."""
        def step_s(drafts: np.ndarray, misses: np.ndarray) -> np.ndarray:
            return self.step_time.predict(base_rows + drafts, 1.0 - np.exp(misses), refit)
        return step_s

    def _miss(self) -> np.ndarray | None:
        """log P(an expert is missed) by a window of 1..K_max + 1 tokens (None: dense)."""
        if not self.s.is_moe:
            return None
        if self._miss_cache is None or self._miss_cache[0] != self.overlap:
            miss = miss_log(np.arange(1, self.s.max_k + 2), self.s.num_experts,
                            self.s.top_k, self.overlap)
            self._miss_cache = (self.overlap, miss, miss.tolist())
        return self._miss_cache[1]

    def _probe(self, ks: list[int], caps: list[int]) -> list[int]:
        """Every `probe_interval` steps with a request held at K = 0, all of them draft
        one."""
        idle = [k == 0 and c > 0 for k, c in zip(ks, caps)]
        if not any(idle):
            self._since_probe = 0
            return ks
        self._since_probe += 1
        if self._since_probe < self.probe_interval:
            return ks
        self._since_probe = 0
        self._probed = True
        self.predicted_step_s = None  # the prediction was for the Ks without the probes
        return [1 if i else k for k, i in zip(ks, idle)]

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self._previous.pop(request_id, None)
