"""The adaptive policy's choice of K per request and its cadence: when a batch is solved
(`choose_ks`), how long a solve's Ks are held, the hysteresis and the asked gain, the
drafting's price, and the cuts of proposed drafts (match length, prompt chunks)."""

from __future__ import annotations

import time
from typing import Callable, Union

import numpy as np

from specmoe.spec_decode.adaptive.estimators import running_mean
from specmoe.spec_decode.adaptive.settings import CATCH_UP_HORIZON, AdaptiveSettings
from specmoe.spec_decode.choice import choose_ks, predicted_rate
from specmoe.spec_decode.match_trim import MatchLengthTrim


class _Held:
    """A solve's Ks per request, kept while its requests run (some may have left; none
    joined unless admitted while the batch is off, no probe between) until `every` steps
    have passed."""

    __slots__ = ("ks", "every", "steps", "idle", "expected", "admitted")

    def __init__(self, batch: list[str], ks: list[int], every: int,
                 expected: tuple[float, float] | None = None) -> None:
        self.ks, self.every, self.steps = dict(zip(batch, ks)), every, 1
        self.idle = not any(ks)  # speculation off for the whole batch
        self.expected = expected  # a speculating step's predicted (tokens, seconds)
        self.admitted = False  # requests joined at K = 0 without a solve (`_admits`)

    def joined(self, batch: list[str]) -> list[str] | None:
        """The requests of `batch` this hold has no K for (an empty list while the hold is
        still good, and none joined); None once it expired."""
        if self.steps >= self.every:
            return None
        return [r for r in batch if r not in self.ks]


Pending = Union[list[int], Callable[[], list[int]], None]


def resolve_pending(pending: Pending) -> list[int] | None:
    """The catch-ups of `AdaptivePolicy.choose`'s `pending`, calling it if a function."""
    return pending() if callable(pending) else pending


class Solve:
    """Choosing, holding and cutting (a part of `AdaptivePolicy`, whose state it reads and
    writes)."""

    def _init_solve(self, settings: AdaptiveSettings) -> None:
        self._previous: dict[str, int] = {}
        self._held: _Held | None = None  # the last solve's choice while its batch runs
        # the next step's batch size and, where it speculates as a solve chose, the
        # predicted (tokens, seconds) (None: it does not); None: a probe, or uncalibrated
        self._expect: tuple[int, tuple[float, float] | None] | None = None
        self.matches = MatchLengthTrim(settings.max_k, settings.match_trim_explore_every)
        self._match_of: dict[str, int] = {}  # each proposal's match length, until verified
        self._solve_s, self._solves = 0.0, 0  # a solve's mean seconds, and their count
        self.prompt_cut_steps = 0  # steps whose drafts `beside_prompts` cut
        self._since_solve_s = 0.0  # seconds of forwards and drafting since the last solve
        self.clock = time.perf_counter  # times the solves (tests pin it)

    def choose(self, request_ids: list[str], caps: list[int], base_rows: int,
               pending: Pending = None, remaining: Pending = None) -> dict[str, int]:
        """K per request (at most its cap) for the next step; `base_rows`: the rows the
        step computes without drafts (the predicted time adds the expected draft rows);
        `pending`: per request, the tokens its draft cache lacks (its catch-up, priced by
        `_drafting`, and for probes), or a function giving them, called only on the steps
        that need them (most steps hold their Ks and need none: a lookup per request per
        step is a cost of its own on a target whose steps take a millisecond);
        `remaining`: likewise, the most tokens each request may still generate (its
        max_tokens less those generated; None: `catch_up_horizon` steps)."""
        self._step_drafted = self._step_accepted = 0
        self._draft_call_s, self._expect = 0.0, None
        if not request_ids:
            return {}
        if not self.calibrated:  # the requests' own K
            return {r: min(c, self.s.max_k) for r, c in zip(request_ids, caps)}
        held = self._held
        if held is not None and not self._probed and self._admits(held, request_ids):
            # the common step: the last solve's Ks, kept in plain Python (a solve costs
            # a few numpy calls per draft depth, a twentieth of a small target's step)
            held.steps += 1
            if held.idle and any(caps) and not self._probe_due():
                self._since_probe += 1  # `_probe`'s count, without its lists
                self._expect = (len(request_ids), None)
                return dict.fromkeys(request_ids, 0)
            ks = [min(held.ks[r], c) for r, c in zip(request_ids, caps)]
            return self._keep(request_ids, ks, caps, pending)
        caps_a = np.minimum(np.asarray(caps, dtype=np.int64), self.s.max_k)
        t0 = self.clock()
        ks = self._solve(request_ids, caps_a, base_rows, pending, remaining)
        self._solves += 1
        self._solve_s = running_mean(self._solve_s, self._solves, self.clock() - t0)
        self._since_solve_s = 0.0
        self._back_off(bool(ks.any()))
        return self._keep(request_ids, ks.tolist(), caps, pending)

    def beside_prompts(self, request_ids: list[str], drafts: list[int], base_rows: int,
                       prompt_rows: int) -> list[int]:
        """How many of their proposed `drafts` the decoding requests `request_ids` keep in a
        step that also computes `prompt_rows` rows of prompt chunks (requests that joined
        after the drafts were chosen, or a long prompt's next chunk) beside its `base_rows`
        decoding rows. There a draft row costs what a row adds to that larger, often
        compute-bound step (SmolLM2 on a 2-core EPYC: ~0.65 ms beside a 749-row prefill,
        against ~0.35 ms in an eight-request decode step), and the drafting is paid. The
        drafts are priced at that margin against a plain decode step's rate: the prompt rows
        take as long with or without them, so they must beat what a decode step yields a
        second, not the prompt step's. Only lowers the counts; the held choice is left as
        it is. Before calibration, or on a probe's step, the drafts are kept."""
        caps = np.asarray(drafts, dtype=np.int64)
        if not self.calibrated or self._probed or not caps.any() or prompt_rows <= 0:
            return list(drafts)
        # proposed drafts fill their slots: a slot's gain is its acceptance alone
        gains = np.stack([np.cumprod(self.acceptance.rates(r)) for r in request_ids])
        miss = self._miss()
        zero = np.zeros(1)
        base_miss = np.full(1, len(request_ids) * miss[0] if miss is not None else 0.0)
        plain, busy = self._step_fn(base_rows), self._step_fn(base_rows + prompt_rows, False)
        offset = float(plain(zero, base_miss)[0] - busy(zero, base_miss)[0])

        def step_s(rows, misses, var=None):
            return busy(rows, misses, var) + offset
        kept, _ = choose_ks(gains, caps, step_s, 0.0, miss_step=miss,
                            min_gain=self._asked_gain(len(request_ids))[1])
        if (kept != caps).any():
            self._expect = None
            self.prompt_cut_steps += 1
        return kept.tolist()

    def _admits(self, held: _Held, request_ids: list[str]) -> bool:
        """Whether `held` gives this step's Ks without a solve: it has not expired and no
        request joined; or the batch is held off, some of its requests go on, and the
        solves since the last one would exceed `recheck_budget` of the time since: the
        requests that joined are then held at K = 0 with the rest (probes still take
        them) until the budget allows a solve. A solve of 64 requests with a draft model's
        catch-ups priced costs ~4 ms, a tiny-moe step at 64 requests ~7 ms: solving at
        each of the prefill chunks that bring requests in cost 3% of a run held off."""
        joined = held.joined(request_ids)
        if joined is None:
            return False
        if not joined and not held.admitted:
            return True
        if not held.idle or len(joined) == len(request_ids) or self._solves_fit():
            return False
        held.ks.update(dict.fromkeys(joined, 0))
        held.admitted = True
        return True

    @property
    def calibrated(self) -> bool:
        """Whether the step-time model is fitted and, where the draft's catch-ups are
        known, the drafting model too (`min_fit_steps` calls each). Until then every
        request drafts its own K: a policy that turned speculation off on its first fit
        would see the draft again only in probes, each a catch-up on a request's context:
        ~0.3 s on the Qwen2.5-Coder pair, which the 1% `probe_budget` spaces 30 s apart."""
        return self.step_time.coef is not None and self.draft_depth.enough_calls

    def _keep(self, request_ids: list[str], ks: list[int], caps: list[int],
              pending: Pending = None) -> dict[str, int]:
        """The chosen Ks with this step's probes, remembered for the hysteresis; what
        the step is expected to realize (`_expect`)."""
        self._previous = dict(zip(request_ids, self._probe(request_ids, ks, caps, pending)))
        held = self._held
        if self._probed:
            self._expect = None
        elif not any(ks):
            self._expect = (len(ks), None)
        elif held.expected is not None and held.ks == self._previous:
            self._expect = (len(ks), held.expected)
        return dict(self._previous)

    def _solve(self, request_ids: list[str], caps_a: np.ndarray, base_rows: int,
               pending: Pending, remaining: Pending) -> np.ndarray:
        """The best Ks for the batch (docs/adaptive.md, "The choice of K"), with the
        hysteresis; holds the choice (`_Held`)."""
        step_s, miss = self._step_fn(base_rows), self._miss()
        gains, fills = map(np.stack, zip(*(self.acceptance.slots(r) for r in request_ids)))
        drafting = self._drafting(request_ids, gains, caps_a, pending, remaining)
        realized, min_gain = self._asked_gain(len(request_ids))
        ks, rate = choose_ks(gains, caps_a, step_s, miss_step=miss, fills=fills,
                             min_gain=min_gain, **drafting)
        prev = np.array([min(self._previous.get(r, k), c) for r, k, c
                         in zip(request_ids, ks, caps_a)], dtype=np.int64)
        if (prev != ks).any():
            prev_rate = predicted_rate(prev, gains, step_s, miss_step=miss, fills=fills,
                                       **drafting)
            if rate * (realized if ks.any() else 1.0) <= prev_rate * (
                    realized if prev.any() else 1.0) * (1 + self.s.hysteresis):
                ks, rate = prev, prev_rate
        expected = None
        if ks.any():
            tokens = len(ks) + float(gains[np.arange(gains.shape[1]) < ks[:, None]].sum())
            expected = (tokens, tokens / rate)
        self._held = _Held(request_ids, ks.tolist(), self._hold_for(request_ids, ks),
                           expected)
        return ks

    def _asked_gain(self, batch: int) -> tuple[float, float]:
        """(f, the least relative gain over no speculation a choice at `batch` requests must
        predict): f the share of its predicted rate speculation realized there (1 without
        the realized check), the gain (1 + min_gain) / f - 1."""
        realized = self.realized.factor(batch) if self.s.realized_check else 1.0
        return realized, (1 + self.s.min_gain) / realized - 1

    def _hold_for(self, request_ids: list[str], ks: np.ndarray) -> int:
        """Steps a solve's Ks are held: with speculation off, twice the last hold if that
        one was off too (at most `recheck_every_max`: requests joining or leaving keep it
        growing), else `recheck_every`; else twice the last hold if the solve confirmed
        its Ks (at most `resolve_every_max`), else `resolve_every`."""
        held = self._held
        if not ks.any():
            if self.s.shadow_every:
                return self._shadow_recheck(len(request_ids))
            if held is not None and held.idle:
                return min(2 * held.every, self.s.recheck_every_max)
            return self.s.recheck_every
        if held is not None and held.ks == dict(zip(request_ids, ks.tolist())):
            return min(2 * held.every, self.s.resolve_every_max)
        return self.s.resolve_every

    def _drafting(self, request_ids: list[str], gains: np.ndarray, caps: np.ndarray,
                  pending: Pending, remaining: Pending) -> dict:
        """The drafting's price, `choose_ks`' keyword arguments. Where the catch-ups are
        known and the draft's model of them fitted: a call's fixed seconds, the steady
        seconds per depth and each request's share of its catch-up in seconds
        (`DraftDepthModel`). Else the mean seconds per depth, catch-ups averaged in."""
        model = self.draft_depth
        pending = resolve_pending(pending)
        if pending is not None:
            model.refresh()
        if pending is None or model.coef is None:
            return {"draft_s": self.draft_s}
        extra = self._catch_up_shares(request_ids, gains, caps, pending, remaining)
        per_call, per_depth, per_token = model.coef
        return {"draft_s": per_depth, "draft_call_s": per_call, "starts": per_token * extra}

    def _catch_up_shares(self, request_ids: list[str], gains: np.ndarray, caps: np.ndarray,
                         pending: list[int], remaining: Pending) -> np.ndarray:
        """[B] each request's catch-up tokens beyond its first charged to this step: in full
        for one that drafted on the previous step (they recur on every step), else spread
        over the steps it may draft for, which pay it once: its remaining tokens over its
        expected tokens per step at its cap, at most `catch_up_horizon` (a request may end
        before its max_tokens)."""
        extra = np.maximum(np.asarray(pending, dtype=float) - 1.0, 0.0)
        steps = np.full(extra.shape, float(CATCH_UP_HORIZON))
        remaining = resolve_pending(remaining)
        if remaining is not None:
            allowed = np.arange(gains.shape[1])[None, :] < caps[:, None]
            per_step = 1.0 + np.where(allowed, gains, 0.0).sum(axis=1)
            steps = np.clip(np.asarray(remaining, dtype=float) / per_step, 1.0, steps)
        resuming = np.array([self._previous.get(r, 0) == 0 for r in request_ids])
        return np.where(resuming, extra / steps, extra)

    def _step_fn(self, base_rows: int, refit: bool = True):
        """(drafts, log expert misses, drafts' variance) -> predicted forward seconds, for
        a batch whose forward computes `base_rows` rows before drafts."""
        def step_s(drafts: np.ndarray, misses: np.ndarray, var=None) -> np.ndarray:
            return self.step_time.predict(base_rows + drafts, 1.0 - np.exp(misses), refit,
                                          var)
        return step_s

    def trim(self, request_ids: list[str], proposed: list[int], match_lengths: list[int],
             base_rows: int) -> list[int]:
        """How many of each proposal's `proposed` drafts to verify (`match_trim`,
        `MatchLengthTrim.cut`): the prompt-lookup drafts that, given their match lengths,
        maximise the step's expected tokens per second under the step-time model. Steps a
        solve did not choose (probes, uncalibrated) and draft models' proposals (match
        length 0) keep everything. `base_rows`: the step's rows without drafts."""
        if not self.s.match_trim or not any(match_lengths):
            return proposed
        for r, n in zip(request_ids, match_lengths):
            self._match_of[r] = n
        if self._expect is None or self._expect[1] is None or self.step_time.coef is None:
            return proposed
        return self._cut(match_lengths, proposed, base_rows)

    def _cut(self, match_lengths: list[int], proposed: list[int], base_rows: int,
             explore: bool = True) -> list[int]:
        """`MatchLengthTrim.cut` priced by the step-time model, for a step of `base_rows`
        rows before drafts (the fitted model required)."""
        predict = self.step_time.predict_one
        if not self.s.is_moe:  # the rows alone: no windows built per draft counted
            return self.matches.cut(match_lengths, proposed,
                                    lambda keep: predict(base_rows + sum(keep)), explore)
        idle = [1] * max(base_rows - len(proposed), 0)  # requests without a proposal
        return self.matches.cut(match_lengths, proposed, lambda keep: predict(
            base_rows + sum(keep), self.unique_fraction([1 + k for k in keep] + idle)),
            explore)
