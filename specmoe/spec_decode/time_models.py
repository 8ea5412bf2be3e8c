"""Time models of the adaptive speculation policy (`spec_decode.adaptive`): the target
step's seconds from its rows (and, on a MoE target, the share of experts its windows touch),
and a draft model's seconds per forward from its rows, both increasing piecewise-linear
functions fitted online by non-negative least squares on relative error
(scipy.optimize.nnls): convex from two rows on, plus a step from one row to two, where the
matrix-vector kernels give way to matrix-matrix ones (SmolLM2-135M in bf16 on a 2-core AMD
EPYC: 6.2 ms at one row, 7.9 at two, then 0.35 ms a row up to 8; a line through them
priced a speculating request's first draft at a third of its cost and the later ones at
twice theirs)."""

from __future__ import annotations

from collections import deque

import numpy as np

# rows where the step time's slope may grow; the one at 4 for small cached models: SmolLM2
# inside a 300 MiB L3 (2-core Xeon) ran flat to ~5 rows, then 1.7 ms a row
KNOTS = (4, 8, 32, 128)


def _scipy():
    """scipy with the modules the models use (nnls, ndtr), imported on first use: ~0.6 s,
    which an engine without an adaptive policy should not pay, and which an adaptive one
    should pay when it is built, not inside its first timed steps (it cost the first
    repetition of a benchmark at one request 15%)."""
    import scipy.optimize
    import scipy.special
    return scipy


def _relative_nnls(feats: np.ndarray, secs: np.ndarray) -> np.ndarray:
    """Non-negative weights w minimising the relative error of feats @ w against secs
    ([n, f], [n] -> [f]): a long prefill or catch-up must not outweigh a hundred short
    steps."""
    return _scipy().optimize.nnls(feats / secs[:, None], np.ones_like(secs))[0]


class _CallWindow:
    """The recent calls a drafting model is fitted on: the first fit once `min_calls` are
    in, then one after every 4 more."""

    def __init__(self, window: int, min_calls: int) -> None:
        self._calls: deque = deque(maxlen=window)
        self.min_calls = min_calls
        self.coef = None
        self._observed = 0
        self._fitted_at = 0

    def _record(self, call: tuple) -> None:
        self._calls.append(call)
        self._observed += 1

    def _fit_due(self) -> bool:
        """Whether `refresh` should fit now (and count the fit as made)."""
        if len(self._calls) < self.min_calls or (
                self.coef is not None and self._observed - self._fitted_at < 4):
            return False
        self._fitted_at = self._observed
        return True


_HINGES = np.array((1.0, 2.0) + KNOTS)  # the ramp's two hinges, then the knots


def _hinges(mean: np.ndarray, var) -> np.ndarray:
    """[..., len(_HINGES)]: E[max(0, r - h)] for each hinge h, r ~ Normal(mean, var) (var
    None: r = mean)."""
    gap = mean[..., None] - _HINGES
    if var is None:
        return np.maximum(gap, 0.0)
    sd = np.sqrt(np.maximum(np.asarray(var, dtype=float), 1e-12))[..., None]
    z = gap / sd
    density = np.exp(-0.5 * z * z) * (1.0 / np.sqrt(2.0 * np.pi))
    return gap * _scipy().special.ndtr(z) + sd * density


def _row_features(rows, unique_frac=None, var=None) -> np.ndarray:
    """[..., 2 + 1 + len(KNOTS) (+ 1)]: 1; the step from one row to two, clip(r - 1, 0, 1);
    r; the hinges; on a MoE target the share of experts touched. With `var` (the rows'
    variance, same shape), their expectations for rows ~ Normal(rows, var)."""
    r = np.asarray(rows, dtype=float)
    h = _hinges(r, var)
    cols = [np.ones_like(r)[..., None], h[..., :1] - h[..., 1:2], r[..., None], h[..., 2:]]
    if unique_frac is not None:
        cols.append(np.broadcast_to(np.asarray(unique_frac, dtype=float), r.shape)[..., None])
    return np.concatenate(cols, axis=-1)


class StepTimeModel:
    """Target forward seconds as an increasing piecewise-linear function of rows, plus c_U U/N
    on a MoE target (module docstring), non-negative least squares on a window of steps."""

    def __init__(self, window: int, min_steps: int, moe: bool = False) -> None:
        _scipy()  # imported here, not on the first fit inside a timed step
        self._steps: deque[tuple[int, float, float]] = deque(maxlen=window)
        self.min_steps = min_steps
        self.moe = moe
        self.coef = None
        self._observed = 0
        self._fitted_at = 0  # steps observed at the last fit
        self._floor = 0.0  # least seconds a prediction may give (set by each fit)

    @property
    def coef(self) -> np.ndarray | None:
        """The fit's weights, in `_row_features`' order (None before the first fit)."""
        return self._coef

    @coef.setter
    def coef(self, value: np.ndarray | None) -> None:
        self._coef = value
        # `predict_one` runs every step, and numpy scalars' arithmetic is slower than floats'
        self._coef_floats = None if value is None else value.tolist()

    def observe(self, rows: int, seconds: float, unique_frac: float = 0.0) -> None:
        """Record a step (the first fit as soon as `min_steps` are in; later ones when a
        prediction asks)."""
        self._steps.append((rows, seconds, unique_frac))
        self._observed += 1
        if self.coef is None and len(self._steps) >= self.min_steps:
            self._fit()

    def refresh(self) -> None:
        """Refit once an eighth of the window (at least 4 steps) came in since the last
        fit: a fit costs ~0.3 ms, and a few new steps in a full window hardly move it."""
        if self.coef is not None and (self._observed - self._fitted_at
                                      >= max(4, len(self._steps) // 8)):
            self._fit()

    def _fit(self) -> None:
        rows, secs, frac = np.array(self._steps, dtype=float).T
        self.coef = _relative_nnls(_row_features(rows, frac if self.moe else None), secs)
        self._fitted_at = self._observed
        # a fit on large steps alone may put every weight on the hinges, predicting 0 s
        # for a few rows; no step runs faster than half the fastest one seen
        self._floor = 0.5 * float(secs.min())

    def predict_one(self, rows: int, unique_frac: float = 0.0) -> float | None:
        """`predict` for one step from the last fit, in plain floats (no refit)."""
        if self.coef is None:
            return None
        c = self._coef_floats
        seconds = c[0] + c[1] * min(max(rows - 1.0, 0.0), 1.0) + c[2] * rows
        for cj, knot in zip(c[3:3 + len(KNOTS)], KNOTS):
            if rows > knot:
                seconds += cj * (rows - knot)
        return max(self._floor, seconds + (c[-1] * unique_frac if self.moe else 0.0))

    def predict(self, rows, unique_frac=0.0, refit: bool = True, var=None):
        """Seconds at `rows` (a number or an array) and, on a MoE target, the windows'
        share of experts (same shape); None before the first fit. `var`: the rows'
        variance (same shape): the expected seconds for rows ~ Normal(rows, var), more
        than the seconds at the mean rows where the time bends upwards (Jensen), as for a
        step whose rows vary (prompt lookup fills a slot only where a match runs on).
        `refit=False` skips refitting on the steps observed since the last fit (a cheap,
        slightly stale prediction)."""
        if refit:
            self.refresh()
        if self.coef is None:
            return None
        feats = _row_features(rows, unique_frac if self.moe else None, var)
        return np.maximum(feats @ self.coef, self._floor)


class DraftDepthModel(_CallWindow):
    """A draft model's seconds per call as c + d x depth + e x catch-up: c the call's fixed
    cost (dispatch, sampling set-up), d the seconds per draft token of the batch (one
    forward each), e the seconds per token of catch-up beyond the one each drafting request
    runs anyway (the context its draft cache lacks: a prompt, or the tokens generated
    while it did not draft), fitted by non-negative least squares (relative error) on a
    window of calls. A call that runs a 300-token prompt through the 0.5B Qwen2.5-Coder
    draft (int4, 2-core AMD EPYC) takes ~250 ms against ~42 ms for four steady draft
    tokens: averaged into d, the catch-ups priced every drafting step at up to five times
    its cost. Without c, d from the calls at K = 8 of probes priced tiny-moe's draft at
    K = 1 below its fixed cost, and the policy drafted where it lost (0.84x plain)."""

    coef: tuple[float, float, float] | None  # (c, d, e) seconds

    def observe(self, depth: int, catch_ups: list[int], seconds: float) -> None:
        """A call of `depth` draft tokens per request (at most) over requests whose draft
        caches lacked `catch_ups` tokens each (at least 1), that took `seconds`."""
        if depth > 0 and catch_ups and seconds > 0:
            self._record((1.0, float(depth), float(sum(catch_ups) - len(catch_ups)),
                          seconds))

    @property
    def enough_calls(self) -> bool:
        """None observed (the proposer has no catch-ups), or at least `min_calls`."""
        return not self._observed or self._observed >= self.min_calls

    def refresh(self) -> None:
        """Fit once `min_calls` calls are in, then again after every 4 more."""
        if self._fit_due():
            calls = np.array(self._calls)
            c, d, e = _relative_nnls(calls[:, :3], calls[:, 3]).tolist()
            self.coef = (c, d, e)
