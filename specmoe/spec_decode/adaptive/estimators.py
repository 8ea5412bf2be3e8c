"""What the adaptive policy estimates from the steps it observes: draft acceptance per
request and position (`AcceptanceTracker`), and the policy's observation methods that feed
its time models, routing overlap and drafting price (`Estimation`)."""

from __future__ import annotations

import math

import numpy as np

from specmoe.spec_decode.adaptive.settings import (ACCEPTANCE_OPTIMISM, OVERLAP_PRIOR,
                                                   PRIOR_STRENGTH, REALIZED_PRIOR_STEPS,
                                                   REALIZED_WINDOW, REALIZED_Z, TIME_WINDOW,
                                                   AdaptiveSettings)
from specmoe.spec_decode.realized import RealizedGain
from specmoe.spec_decode.routing_overlap import miss_log, unique_fraction
from specmoe.spec_decode.time_models import DraftDepthModel, StepTimeModel


class AcceptanceTracker:
    """Draft acceptance per position, engine-wide and per request, and how often the
    proposer fills each allowed draft slot (prompt lookup proposes only what follows a
    match; a draft model fills every slot)."""

    def __init__(self, max_k: int, prior_strength: float, optimism: float = 0.0) -> None:
        self.max_k, self.prior_strength, self.optimism = max_k, prior_strength, optimism
        self.engine = np.zeros((2, max_k))  # [reached, accepted] per position
        self.engine_fill = np.zeros((2, max_k))  # [allowed, filled] per slot
        self._requests: dict[str, np.ndarray] = {}
        self._fills: dict[str, np.ndarray] = {}

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts of which the first `accepted` were accepted:
        positions 0..accepted were reached (the first rejection included)."""
        drafted = min(drafted, self.max_k)
        if drafted > 0:
            self.engine += self._count(self._requests, request_id,
                                       min(accepted + 1, drafted), min(accepted, drafted))

    def observe_proposed(self, request_id: str, allowed: int, proposed: int) -> None:
        """A proposal of `proposed` tokens where `allowed` were asked for."""
        allowed = min(allowed, self.max_k)
        if allowed > 0:
            self.engine_fill += self._count(self._fills, request_id, allowed,
                                            min(proposed, allowed))

    def _count(self, table: dict[str, np.ndarray], request_id: str, trials: int,
               successes: int) -> np.ndarray:
        """Add one outcome to the request's [trials, successes] per position (the first
        `trials` positions tried, the first `successes` succeeded); returns the counts."""
        counts = np.zeros((2, self.max_k))
        counts[0, :trials] = 1
        counts[1, :successes] = 1
        table.setdefault(request_id, np.zeros((2, self.max_k)))
        table[request_id] += counts
        return counts

    def rates(self, request_id: str) -> np.ndarray:
        """[max_k] estimated acceptance rate of a reached draft at each position."""
        reached = self.engine[0]
        prior = (self.engine[1] + 1) / (reached + 2)
        if self.optimism:  # the data's standard error, weighted as the data are in the mean
            prior = np.minimum(1.0, prior + self.optimism * np.sqrt(
                prior * (1 - prior) * reached) / (reached + 2))
        return self._shrunk(self._requests.get(request_id), prior)

    def fills(self, request_id: str) -> np.ndarray:
        """[max_k] estimated chance that each allowed slot is filled (1 until proposals
        say otherwise; at least 0.01), non-increasing."""
        allowed, filled = self.engine_fill
        prior = (filled + 1) / (allowed + 1)
        f = self._shrunk(self._fills.get(request_id), prior)
        return np.maximum(np.minimum.accumulate(f), 0.01)

    def _shrunk(self, own: np.ndarray | None, prior: np.ndarray) -> np.ndarray:
        """A request's [trials, successes] per position shrunk towards `prior` by
        `prior_strength` pseudo-trials (Beta-binomial)."""
        if own is None:
            return prior
        s = self.prior_strength
        return (own[1] + s * prior) / (own[0] + s)

    def gains(self, request_id: str) -> np.ndarray:
        """[max_k] expected tokens the j-th slot adds (`slots`)."""
        return self.slots(request_id)[0]

    def slots(self, request_id: str) -> tuple[np.ndarray, np.ndarray]:
        """([max_k] expected tokens the j-th slot adds: its fill chance times
        prod_{i<=j} rates, [max_k] the fill chances)."""
        fills = self.fills(request_id)
        return fills * np.cumprod(self.rates(request_id)), fills

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._fills.pop(request_id, None)


def running_mean(mean: float, count: int, value: float) -> float:
    """The mean of the first values, then a moving average weighting the newest by 0.1;
    `count` includes `value`."""
    return mean + max(1.0 / count, 0.1) * (value - mean)


class Estimation:
    """The adaptive policy's observations (a part of `AdaptivePolicy`, whose state it
    reads and writes)."""

    def _init_estimation(self, settings: AdaptiveSettings) -> None:
        self.acceptance = AcceptanceTracker(settings.max_k, PRIOR_STRENGTH,
                                            ACCEPTANCE_OPTIMISM)
        self.step_time = StepTimeModel(TIME_WINDOW, settings.min_fit_steps, settings.is_moe)
        self.overlap = OVERLAP_PRIOR
        self._overlap_obs = 0
        # (overlap, log-miss of windows of 1..max_k + 1 tokens as an array and a list)
        self._miss_cache: tuple[float, np.ndarray, list[float]] | None = None
        self.draft_s = 0.0
        self._draft_obs = 0
        self.draft_depth = DraftDepthModel(TIME_WINDOW, settings.min_fit_steps)
        self.realized = RealizedGain(REALIZED_WINDOW, REALIZED_PRIOR_STEPS, REALIZED_Z)
        self._idle_steps = 0  # steps observed while held at K = 0
        self._step_drafted = self._step_accepted = 0  # the step's verified drafts
        self._draft_call_s = 0.0  # the drafting call before the step

    def observe_verified(self, request_id: str, drafted: int, accepted: int) -> None:
        self.acceptance.observe(request_id, drafted, accepted)
        if self._match_of:
            self.matches.observe(self._match_of.pop(request_id, 0), drafted, accepted)
        self._step_drafted += drafted
        self._step_accepted += accepted

    def observe_proposed(self, request_id: str, allowed: int, proposed: int) -> None:
        """The proposer drafted `proposed` of the `allowed` tokens asked for."""
        self.acceptance.observe_proposed(request_id, allowed, proposed)

    def observe_step(self, rows: int, seconds: float, windows: list[int] | None = None
                     ) -> float | None:
        """Record the forward's time (`windows`: the rows of each request in it, for a MoE
        target's expert share); returns the relative error of the time model's prediction
        of it from the last fit (None before the first fit). The step as run, not as the
        choice expected it: prompt lookup's drafts and new requests' prompt chunks are
        only known once scheduled. While the batch is held at K = 0 one step in
        `idle_observe_every` is recorded: those steps repeat one another's rows, and
        recording each cost tiny-moe ~2% of its step."""
        if self._probed and self._step_drafted:  # the probe's drafts were verified here
            self._probe_cost_s += self._probe_excess(rows, seconds)
        if self._held is not None and self._held.idle:
            self._idle_steps += 1
            if self._idle_steps % self.s.idle_observe_every:
                self._spend(seconds)
                return None
        self._spend(seconds)
        windows = windows or [rows]
        expect = self._expect
        if (expect is not None and expect[1] is not None and len(windows) == expect[0]
                and rows == expect[0] + self._step_drafted):  # decode only, as chosen
            self.realized.observe_on(expect[0], expect[0] + self._step_accepted,
                                     seconds + self._draft_call_s, *expect[1])
        return self._timed(rows, seconds, windows)

    def _timed(self, rows: int, seconds: float, windows: list[int]) -> float | None:
        """Add a step's timing to the time model, and to the realized sums where it
        decoded one token per request, held at K = 0; the relative error of its
        prediction from the last fit (None before the first fit)."""
        frac = self.unique_fraction(windows)
        predicted = self.step_time.predict_one(rows, frac)
        self.step_time.observe(rows, seconds, frac)
        if predicted is None:
            return None
        if self._expect == (rows, None) and len(windows) == rows:
            self.realized.observe_off(rows, seconds, predicted)
        return abs(predicted - seconds) / seconds

    def _spend(self, seconds: float) -> None:
        """Count a forward's or a drafting call's seconds towards the probes' and the
        solves' time budgets."""
        self._elapsed_s += seconds
        self._since_solve_s += seconds

    def observe_overlap(self, overlap: float) -> None:
        """An adjacent-token routing overlap measured on a sampled step (MoE targets)."""
        self._overlap_obs += 1
        self.overlap = running_mean(self.overlap, self._overlap_obs, overlap)

    def unique_fraction(self, windows: list[int]) -> float:
        """U / N of a step's windows on a MoE target (0 on a dense one)."""
        if not self.s.is_moe:
            return 0.0
        self._miss()
        miss = self._miss_cache[2]  # the same log-misses as a list: no numpy per step
        if max(windows) > len(miss):  # a prompt chunk: beyond the cached window lengths
            return unique_fraction(windows, self.s.num_experts, self.s.top_k, self.overlap)
        return 1.0 - math.exp(sum(miss[t - 1] for t in windows))

    def _miss(self) -> np.ndarray | None:
        """log P(an expert is missed) by a window of 1..K_max + 1 tokens (None: dense)."""
        if not self.s.is_moe:
            return None
        if self._miss_cache is None or self._miss_cache[0] != self.overlap:
            miss = miss_log(np.arange(1, self.s.max_k + 2), self.s.num_experts,
                            self.s.top_k, self.overlap)
            self._miss_cache = (self.overlap, miss, miss.tolist())
        return self._miss_cache[1]

    def observe_draft(self, depth: int, seconds: float,
                      catch_ups: list[int] | None = None) -> None:
        """A drafting call of `depth` tokens per request that took `seconds`, the draft
        model's catch-up on context it had not seen included (`catch_ups`: per drafting
        request, the tokens its draft cache lacked, for `DraftDepthModel`). The mean seconds per
        depth, catch-ups averaged in, prices drafting where the catch-ups are unknown
        (prompt lookup has none) or until `DraftDepthModel` is fitted."""
        if catch_ups:
            self.draft_depth.observe(depth, catch_ups, seconds)
        if depth > 0:
            self._draft_obs += 1
            self.draft_s = running_mean(self.draft_s, self._draft_obs, seconds / depth)
        self._spend(seconds)
        self._draft_call_s = seconds
        if self._probed:
            self._probe_cost_s += seconds
