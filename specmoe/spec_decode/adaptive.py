"""Adaptive speculation (`SpeculativeConfig.policy = "adaptive"`): before each step, every
running request's K in 0..its own K is chosen to maximise the batch's expected tokens per
second (the choice in `spec_decode.choice`, the time models in `spec_decode.time_models`).

- Acceptance: per request and draft position, the rate at which a reached draft is accepted,
  shrunk towards the engine-wide rate by `prior_strength` pseudo-drafts (a Beta-binomial
  estimate), so that a new request starts at the engine's rate and moves to its own as it
  drafts. The engine-wide rate is taken optimistically, `acceptance_optimism` standard
  errors of its data above its mean (an upper confidence bound, as in UCB bandit policies,
  Auer et al. 2002; the error sqrt(p (1 - p) / n) weighted n / (n + 2), as the n reached
  drafts are in the mean, so a position never reached keeps the uniform prior's 1/2):
  while few drafts have been verified, a poor start (the first drafts of a warm-up
  rejected) does not switch speculation off for good, since once off only probes bring
  data; over many drafts the bound meets the mean. The j-th draft adds prod_{i<=j} a_i
  expected tokens, so K drafts give 1 + sum_{j<K} prod_{i<=j} a_i (Leviathan et al. 2023,
  arXiv 2211.17192, eq. 1, with position-dependent rates).
- Step time: the target forward's seconds as an increasing piecewise-linear function of its
  rows (the tokens it computes): c0 + c_s clip(r - 1, 0, 1) + c1 r + sum_j c_j max(0, r -
  knot_j), all c >= 0, fitted online by non-negative least squares (relative error) on the
  recent steps' timings (`time_models`). Few rows cost little more than one (the weights
  are read once: memory-bound), many rows cost in proportion (compute-bound); the hinges
  let prefill chunks calibrate the second regime without making a few draft rows look
  expensive; c_s is the step from one row to two (matrix-vector to matrix-matrix kernels),
  paid by a single request's first draft. On a MoE target one more term,
  c_U U/N: the share of experts the step's windows touch (`routing_overlap`: expected from
  the adjacent-token overlap measured live on sampled steps), since a memory-bound MoE layer
  reads each touched expert once, so K drafts of one request cost about the experts they
  add, not K rows. Drafting costs d x depth (the deepest request's K: a draft model runs
  the batch that many times) plus, for a draft model, c per call and e per token of each
  drafting request's catch-up (the tokens its draft cache lacks beyond the one it runs
  anyway: a prompt, or what was generated while it did not draft), c, d and e fitted on
  the draft's calls (`DraftDepthModel`); where the catch-ups are unknown (prompt lookup has none), d
  is the mean seconds per depth. With `draft_rows_model`, the draft's forwards are priced
  by their rows instead (`DraftTimeModel`): the first forward runs every drafting
  request's catch-up, each later one the requests still drafting. A request that did not
  draft on the previous step pays its catch-up once for the steps it then drafts, so the
  step that starts it is charged the catch-up over those steps: its remaining tokens
  (max_tokens less those generated) over its expected tokens per step, at most
  `catch_up_horizon`. A prompt's catch-up through the 0.5B Qwen2.5-Coder draft (~3 ms a
  token) is worth paying for a 32-token answer, a late resume's for the last few tokens
  is not. Until both models are fitted every request drafts its own K (`calibrated`).
- Choice: for a given draft depth D and number n of drafts, the best drafts are the n with
  the most expected tokens (each request's are non-increasing in position, so they are a
  prefix of each request's); the best n maximises tokens / seconds. Each D = 0..K_max is
  tried, and the best kept. (With per-request catch-ups a request's first draft carries a
  cost of its own, and the prefix is then a greedy approximation; the search is rerun
  with the requests of dearest catch-ups left out, `choice.choose_ks`.)
- A margin: speculation turns on only where predicted `min_gain` faster than none. What
  the step-time model leaves out costs about that much: the policy's own bookkeeping and
  the proposer's fixed cost per call (0.5-0.7 ms of a 15 ms SmolLM2 step at eight
  requests), and finishes staggered by speculation (requests then join one by one, their
  prompts in steps of their own). SmolLM2 with prompt lookup on half code, half
  translation prompts at eight requests: speculating raised the tokens per second of full
  decode steps by 1-5% and lowered the whole run's by 2-4%.
- A realized check (`realized_check`, `spec_decode.realized`): per batch size (pooled
  within powers of two), the tokens per second that the steps run as a solve chose them
  realized (their forward and the drafting call before it, catch-ups included), against
  the rate the solve predicted, relative to the same on the steps without drafts; where
  speculation realized a share f of its predicted rate, a choice must predict
  (1 + min_gain) / f, f read at the upper end of its interval (`realized_z` standard
  errors), so a few noisy steps do not turn off a real gain. Where the gain is thin
  what the model leaves out decides it: a request that resumes drafting pays its whole
  catch-up at once and may stop a few steps later, and a first accepted draft reads as a
  high acceptance.
- Hysteresis: the previous step's Ks stay unless the new choice is predicted `hysteresis`
  faster. Re-probing: after `probe_every` steps in which some request is held at K = 0, all
  such requests draft their own K (at most K_max) on the same step: a probe of one token
  would only ever re-measure the first position, leaving a poor early estimate of the deeper
  ones in place for good. Probing together keeps their acceptance estimates current, so
  speculation returns where it would pay, and runs the draft model once for the batch (a
  draft model must first catch up on the request's tokens, so
  staggered probes would run it on nearly every step). A probe costs a draft catch-up, a
  few target steps' worth on a small target, so each probe after which the batch stays off
  doubles the interval, up to `probe_every_max` steps; a solve that turns speculation on
  resets it (exponential backoff, as for retries). Where the catch-ups are known (a draft
  model's cache), a probe takes the held requests with the least catch-up first, up to
  `probe_catch_up_rows` catch-up tokens in all, and none whose catch-up alone exceeds that
  (then the count restarts): probing sixteen requests held since their prompts ran their
  whole prompts through the draft, 10% of a 32-token run of the Qwen2.5-Coder pair at 16
  requests, and probing one request held since its 693-token prompt took 1.7 s, 8% of a
  run at one request. Then the requests probed least often go first while their drafts fit
  `probe_drafts` slots (at least one request): probing all sixteen requests of SmolLM2 at
  K = 8 added 128 rows to a step, and the one or two probes of a 48-token run cost 6%.
  And a probe waits until its cost is at most `probe_budget` (1%) of the time since the
  last one, timed on that one: its drafting (the draft's catch-up included) and what its
  verification step took beyond the step without its drafts taking as long for the tokens
  they added (`_probe_excess`), bounding what probes cost as Cascade's utility test bounds
  a slowdown (arXiv 2506.20675): on a carved Qwen2.5-Coder MoE with the 0.5B draft,
  probes of 32-token requests at one request cost 12% of the run; on tiny-moe at 16
  requests, with the drafting alone counted, probes at K = 8 cost 2.5%, their
  verification three times their drafting.
- Shadow drafts (`shadow_every`, `spec_decode.shadow`; prompt lookup only): a request held
  at K = 0 is still proposed for every `shadow_every` tokens, and the proposal, never
  verified, is scored against the tokens the request then emits (a one-hot draft is
  accepted exactly when the target emits it), counted as the proposal the match-length
  trim would keep (`observe_shadow`). Its acceptance then stays current between probes
  at no cost in target rows, and a batch kept off is re-solved as soon as the solves fit
  `recheck_budget` of its steps' time (at least every `shadow_every` steps) instead of
  the doubling recheck below, which is for batches nothing informs.
- Held choices: a solve's Ks stay for the same batch (probes aside) without re-solving
  until a probe's results are in, a request joins or `resolve_every` steps have passed
  (`recheck_every` while every request is at K = 0: nothing informs the choice while no
  request drafts): a solve and the refit it asks for cost ~0.3 ms, 3% of a SmolLM2 step,
  and the estimates they read move little from one step to the next. A solve that
  returns the Ks it held doubles the hold, up to `resolve_every_max` steps; one that
  changes them (or a new batch) restarts it at `resolve_every`. One that keeps the batch
  off doubles it too, up to `recheck_every_max`, whatever joined or left; a request that
  joins a batch held off (some of whose requests go on) waits at K = 0 for its solve
  until the solves fit `recheck_budget` of the time since the last (a solve of 64
  requests costs ~4 ms, half a tiny-moe step there). The step-time model is refitted
  only when a solve needs it, and only once an eighth of its window is new. A batch held
  off is leased its steps (`IdleLease`): the engine skips the policy until a probe, a
  solve (of requests admitted at K = 0 too) or the hold's end is due: on tiny-moe, whose
  steps take under a millisecond, the held path's lists and rechecks cost 3-5% of a
  step, and at four requests, one joining every 32 steps, the steps between an admission
  and its solve are 18% of the run.
- Prompt lookup fills a slot only where the context has a match: the chance that each
  allowed slot is filled is tracked like acceptance (per request, shrunk towards the
  engine's), and a slot adds that many expected tokens and rows: deep K costs little
  where matches are short or rare. But the rows then vary from step to step (all of a
  request's slots filled where its match runs on, none where it has none), and a step
  costs the mean of its times, not the time of its mean rows: where the time bends
  upwards (SmolLM2-135M at two requests: flat to ~10 rows, then 0.5 ms a row) two
  requests at K = 8 filled half the time average 10 rows but run 18 on a quarter of the
  steps. The step is priced at its expected time for rows ~ Normal(mean, variance) (the
  hinges' expectations in closed form, `time_models`); priced at the mean rows, the
  policy drafted like static K = 8 where K = 4 was faster.
- Match-length trim (`match_trim`, `spec_decode.match_trim`): once prompt lookup has
  proposed, the proposals are cut to the drafts that, given their match lengths
  (acceptance per position tracked per length, engine-wide), maximise the step's expected
  tokens per second under the step-time model. The per-request estimates above then
  describe the cut proposals (their fill and acceptance as verified), so the solve's K is
  the most a request may keep.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Union

import numpy as np

from specmoe.spec_decode.choice import choose_ks, predicted_rate
from specmoe.spec_decode.match_trim import MatchLengthTrim
from specmoe.spec_decode.realized import RealizedGain
from specmoe.spec_decode.routing_overlap import miss_log, unique_fraction
from specmoe.spec_decode.shadow import ShadowOutcome
from specmoe.spec_decode.time_models import DraftDepthModel, DraftTimeModel, StepTimeModel


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


class IdleLease:
    """Steps ahead on which, while the same requests decode one token each, `choose` is sure
    to hold every request at K = 0 without solving or probing (`AdaptivePolicy.grant_lease`):
    the engine skips the policy on them (`AdaptivePolicy.leased_step`), and the counts
    `choose` and `observe_step` keep are handed over in one go when the lease ends
    (`AdaptivePolicy.end_lease`). On tiny-moe, whose steps take ~0.6 ms at one request,
    the policy's per-step calls cost 15 us a step, 3% of a run held at K = 0; leased, 3 us."""

    __slots__ = ("request_ids", "left", "steps", "seconds")

    def __init__(self, request_ids: list[str], steps: int) -> None:
        """`steps`: those before the held choice expires (a probe coming due, or the
        solve of requests admitted at K = 0, ends the lease earlier,
        `AdaptivePolicy.leased_step`)."""
        self.request_ids, self.left, self.steps, self.seconds = request_ids, steps, 0, 0.0


@dataclass(frozen=True)
class AdaptiveSettings:
    """max_k: the largest K any request may draft; the rest: see the module docstring
    (window: steps the time model is fitted on; min_fit_steps: steps before it is used, the
    requests' own K until then)."""

    max_k: int
    prior_strength: float = 4.0
    acceptance_optimism: float = 1.0  # standard errors above the engine-wide rate
    hysteresis: float = 0.03
    min_gain: float = 0.05
    probe_every: int = 16
    probe_every_max: int = 256
    recheck_every: int = 32
    recheck_every_max: int = 256
    idle_observe_every: int = 4
    resolve_every: int = 4
    resolve_every_max: int = 16
    window: int = 256
    min_fit_steps: int = 8
    draft_rows_model: bool = False  # price drafting by its forwards' rows (DraftTimeModel)
    catch_up_horizon: int = 16  # steps a resuming request's catch-up is spread over
    probe_catch_up_rows: int = 128  # catch-up tokens one probe may run through the draft
    probe_drafts: int = 16  # draft slots one probe may add to the target's step
    probe_budget: float = 0.01  # the share of the time probes may take
    num_experts: int = 0  # a MoE target's routed experts N and top-k (0: dense)
    top_k: int = 0
    overlap_prior: float = 0.4  # adjacent-token overlap until one is measured
    realized_check: bool = True  # ask more gain where speculation realized less (`realized`)
    realized_window: int = 64  # steps the realized sums decay over
    realized_prior_steps: float = 8.0
    realized_z: float = 1.0  # standard errors of evidence before more gain is asked
    match_trim: bool = True  # cut prompt-lookup proposals by their match length
    match_trim_explore_every: int = 16  # every this many-th proposal of a length uncut
    shadow_every: int = 0  # tokens between a held request's shadow drafts (0: none)
    recheck_budget: float = 0.01  # the share of an idle batch's time its solves may take

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


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


def within_budget(chosen: list[bool], keys: list[int], costs: list[int], budget: int,
                  at_least_one: bool = False) -> list[bool]:
    """Of the chosen entries, in ascending order of `keys`, those taken while their costs
    sum to at most `budget` (`at_least_one`: the first whatever its cost)."""
    keep = [False] * len(chosen)
    spent = 0
    for i in sorted((i for i, c in enumerate(chosen) if c), key=keys.__getitem__):
        if spent + costs[i] > budget and (spent or not at_least_one):
            break
        keep[i], spent = True, spent + costs[i]
    return keep


Pending = Union[list[int], Callable[[], list[int]], None]


def _resolve(pending: Pending) -> list[int] | None:
    """The catch-ups of `AdaptivePolicy.choose`'s `pending`, calling it if a function."""
    return pending() if callable(pending) else pending


def _running_mean(mean: float, count: int, value: float) -> float:
    """The mean of the first values, then a moving average weighting the newest by 0.1;
    `count` includes `value`."""
    return mean + max(1.0 / count, 0.1) * (value - mean)


class AdaptivePolicy:
    """Chooses each step's K per request; fed by the engine with what each step verified
    and how long its forward and drafting took."""

    def __init__(self, settings: AdaptiveSettings) -> None:
        self.s = settings
        self.acceptance = AcceptanceTracker(settings.max_k, settings.prior_strength,
                                            settings.acceptance_optimism)
        self.step_time = StepTimeModel(settings.window, settings.min_fit_steps,
                                       settings.is_moe)
        self.overlap = settings.overlap_prior
        self._overlap_obs = 0
        self.draft_s = 0.0
        self._draft_obs = 0
        self.draft_time = DraftTimeModel(settings.window, settings.min_fit_steps)
        self.draft_depth = DraftDepthModel(settings.window, settings.min_fit_steps)
        self._previous: dict[str, int] = {}
        self._since_probe = 0  # steps with a request held at K = 0 since the last probe
        self.probe_interval = settings.probe_every  # grows while probes find nothing
        self._probed = False  # the previous step probed
        self._probe_counts: dict[str, int] = {}  # probes each running request was in
        self._probe_cost_s = 0.0  # the last probe's drafting and verification seconds
        self._elapsed_s = 0.0  # seconds of forwards and drafting since the last probe
        # (overlap, log-miss of windows of 1..max_k + 1 tokens as an array and a list)
        self._miss_cache: tuple[float, np.ndarray, list[float]] | None = None
        self._held: _Held | None = None  # the last solve's choice while its batch runs
        self._idle_steps = 0  # steps observed while held at K = 0
        self.lease: IdleLease | None = None
        self.realized = RealizedGain(settings.realized_window, settings.realized_prior_steps,
                                     settings.realized_z)
        # the next step's batch size and, where it speculates as a solve chose, the
        # predicted (tokens, seconds) (None: it does not); None: a probe, or uncalibrated
        self._expect: tuple[int, tuple[float, float] | None] | None = None
        self._step_drafted = self._step_accepted = 0  # the step's verified drafts
        self._draft_call_s = 0.0  # the drafting call before the step
        self.matches = MatchLengthTrim(settings.max_k, settings.match_trim_explore_every)
        self._match_of: dict[str, int] = {}  # each proposal's match length, until verified
        self._solve_s, self._solves = 0.0, 0  # a solve's mean seconds, and their count
        self.prompt_cut_steps = 0  # steps whose drafts `beside_prompts` cut
        self._since_solve_s = 0.0  # seconds of forwards and drafting since the last solve
        self.clock = time.perf_counter  # times the solves (tests pin it)

    def observe_verified(self, request_id: str, drafted: int, accepted: int) -> None:
        self.acceptance.observe(request_id, drafted, accepted)
        if self._match_of:
            self.matches.observe(self._match_of.pop(request_id, 0), drafted, accepted)
        self._step_drafted += drafted
        self._step_accepted += accepted

    def observe_proposed(self, request_id: str, allowed: int, proposed: int) -> None:
        """The proposer drafted `proposed` of the `allowed` tokens asked for."""
        self.acceptance.observe_proposed(request_id, allowed, proposed)

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

    def observe_shadow(self, outcome: ShadowOutcome, base_rows: int) -> None:
        """A held request's shadow proposal, resolved (`spec_decode.shadow`), counted as
        the proposal the match-length trim would have kept in a step of `base_rows` rows
        with no other drafts, verified: its fill and acceptance, and the whole proposal's
        acceptance for its match length."""
        kept, n = outcome.drafted, outcome.match_length
        if self.s.match_trim and n and kept:
            self.matches.observe(n, outcome.drafted, outcome.accepted)  # the whole proposal
            if self.step_time.coef is not None:
                kept = self._cut([n], [kept], base_rows, explore=False)[0]
        self.acceptance.observe_proposed(outcome.request_id, outcome.allowed, kept)
        if kept:
            self.acceptance.observe(outcome.request_id, kept, min(outcome.accepted, kept))

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

    def _probe_excess(self, rows: int, seconds: float) -> float:
        """Seconds a probe's verification step of `rows` rows took beyond the step without
        its drafts (predicted, each request's window one token) taking as long for the tokens
        the accepted drafts added: on tiny-moe at 16 requests a probe at K = 8 ran 16 ms
        against 2.5 ms steps, three times its 5 ms drafting, for 6% more tokens."""
        base = rows - self._step_drafted
        if base <= 0:  # before predicting: a MoE target's expert share needs a window
            return 0.0
        plain = self.step_time.predict_one(base, self.unique_fraction([1] * base))
        if plain is None:
            return 0.0
        return max(0.0, seconds - plain * (1.0 + self._step_accepted / base))

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

    def observe_draft(self, depth: int, seconds: float,
                      forward_rows: list[float] | None = None,
                      catch_ups: list[int] | None = None) -> None:
        """A drafting call of `depth` tokens per request that took `seconds`, the draft
        model's catch-up on context it had not seen included (`catch_ups`: per drafting
        request, the tokens its draft cache lacked, for `DraftDepthModel`; `forward_rows`:
        the forwards' rows, `call_rows`, for `draft_rows_model`). The mean seconds per
        depth, catch-ups averaged in, prices drafting where the catch-ups are unknown
        (prompt lookup has none) or until `DraftDepthModel` is fitted."""
        if catch_ups:
            self.draft_depth.observe(depth, catch_ups, seconds)
        if depth > 0:
            self._draft_obs += 1
            self.draft_s = _running_mean(self.draft_s, self._draft_obs, seconds / depth)
        self._spend(seconds)
        self._draft_call_s = seconds
        if self._probed:
            self._probe_cost_s += seconds
        if forward_rows:
            self.draft_time.observe(forward_rows, seconds)

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
        self._solve_s = _running_mean(self._solve_s, self._solves, self.clock() - t0)
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

    def grant_lease(self, request_ids: list[str]) -> None:
        """After a `choose` that held every request in `request_ids` at K = 0: lease the
        steps on which, with the same requests, it would again (`IdleLease`): those before
        the held choice expires, before a probe is due (by its count of steps and its
        time budget, `_probe_due`) and, where requests were admitted without a solve,
        before the solves' budget allows one (`_solves_fit`)."""
        held = self._held
        if held is None or not held.idle or self._probed or held.steps >= held.every:
            return
        self.lease = IdleLease(request_ids, held.every - held.steps)

    def leased_step(self, request_ids: list[str] | None, seconds: float) -> bool:
        """Whether the step just run, whose requests decoded one token each and go on
        (`request_ids`, in the lease's order; None: any other step), is a leased one: then
        it is counted (`seconds`: its forward's) and the engine skips `observe_step` and
        `choose`. Otherwise the caller ends the lease (`end_lease`) and the step takes the
        usual path."""
        lease = self.lease
        if lease is None or not lease.left or request_ids != lease.request_ids:
            return False
        total = lease.seconds + seconds
        if self._probe_due(lease.steps, total) or (  # as `choose` would see it here
                self._held.admitted and self._solves_fit(total)):
            return False
        lease.left, lease.steps, lease.seconds = lease.left - 1, lease.steps + 1, total
        return True

    def _solves_fit(self, leased_s: float = 0.0) -> bool:
        """Whether a solve now keeps the solves within `recheck_budget` of the time since
        the last one (counting a running lease's seconds): then requests joining a batch
        held off, or admitted to it at K = 0 (`_admits`), are solved for."""
        return (self._since_solve_s + leased_s) * self.s.recheck_budget >= self._solve_s

    def end_lease(self) -> float | None:
        """End the lease, if any, handing over its steps: the counts `choose` and
        `observe_step` would have kept, and one step timing at their mean (the steps
        repeat one another's rows). Returns the time model's relative error on that mean,
        as `observe_step` does (None: no lease, or no step leased)."""
        lease, self.lease = self.lease, None
        if lease is None or not lease.steps:
            return None
        self._held.steps += lease.steps
        self._since_probe += lease.steps
        self._idle_steps += lease.steps
        self._spend(lease.seconds)
        rows = len(lease.request_ids)
        return self._timed(rows, lease.seconds / lease.steps, [1] * rows)

    def _back_off(self, speculating: bool) -> None:
        """Double the probe interval when the solve after a probe keeps every request at
        K = 0; back to `probe_every` once speculation pays."""
        if speculating:
            self.probe_interval = self.s.probe_every
        elif self._probed:
            self.probe_interval = min(2 * self.probe_interval, self.s.probe_every_max)
        self._probed = False

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
        """The best Ks for the batch (module docstring), with the hysteresis; holds the
        choice (`_Held`)."""
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

    def _shadow_recheck(self, batch: int) -> int:
        """Steps a batch of `batch` requests kept off is held while shadow drafts inform
        its estimates: as many as keep the solves within `recheck_budget` of the steps'
        predicted time, at least `shadow_every` (a shadow's drafts take that many steps to
        be reached), at most `recheck_every_max`."""
        step_s = self.step_time.predict_one(batch, self.unique_fraction([1] * batch))
        steps = (self.s.recheck_every_max if not step_s else
                 math.ceil(self._solve_s / (self.s.recheck_budget * step_s)))
        return int(min(max(steps, self.s.shadow_every), self.s.recheck_every_max))

    def _drafting(self, request_ids: list[str], gains: np.ndarray, caps: np.ndarray,
                  pending: Pending, remaining: Pending) -> dict:
        """The drafting's price, `choose_ks`' keyword arguments. Where the catch-ups are
        known and the draft's model of them fitted: a call's fixed seconds, the steady
        seconds per depth and each request's share of its catch-up in seconds
        (`DraftDepthModel`), or with `draft_rows_model` the least a forward costs and each
        request's rows in the first forward. Else the mean seconds per depth, catch-ups
        averaged in."""
        model = self.draft_time if self.s.draft_rows_model else self.draft_depth
        pending = _resolve(pending)
        if pending is not None:
            model.refresh()
        if pending is None or model.coef is None:
            return {"draft_s": self.draft_s}
        extra = self._catch_up_shares(request_ids, gains, caps, pending, remaining)
        if self.s.draft_rows_model:
            return {"draft_s": float(model.forward_s(1.0)),
                    "draft_rows": (1.0 + extra, model.forward_s)}
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
        steps = np.full(extra.shape, float(self.s.catch_up_horizon))
        remaining = _resolve(remaining)
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

    def _miss(self) -> np.ndarray | None:
        """log P(an expert is missed) by a window of 1..K_max + 1 tokens (None: dense)."""
        if not self.s.is_moe:
            return None
        if self._miss_cache is None or self._miss_cache[0] != self.overlap:
            miss = miss_log(np.arange(1, self.s.max_k + 2), self.s.num_experts,
                            self.s.top_k, self.overlap)
            self._miss_cache = (self.overlap, miss, miss.tolist())
        return self._miss_cache[1]

    def _probe(self, request_ids: list[str], ks: list[int], caps: list[int],
               pending: Pending = None) -> list[int]:
        """Every `probe_interval` steps with a request held at K = 0, once the time since
        the last probe is 1 / `probe_budget` times that probe's cost, they draft their
        cap (at most K_max): those of least catch-up within `probe_catch_up_rows` where
        `pending` gives the catch-ups (none where each exceeds it), then those probed
        least often while their drafts fit `probe_drafts` (at least one)."""
        idle = [k == 0 and c > 0 for k, c in zip(ks, caps)]
        if not any(idle):
            # only speculation restarts the count, not a step where no request may draft
            # (its last token): requests shorter than the interval must still be probed
            if any(ks):
                self._since_probe = 0
            return ks
        if not self._probe_due():
            self._since_probe += 1
            return ks
        self._since_probe = 0
        pending = _resolve(pending)
        if pending is not None:
            idle = within_budget(idle, pending, pending, self.s.probe_catch_up_rows)
            if not any(idle):  # every catch-up over budget: no probe, and no back-off
                return ks
        self._elapsed_s = self._probe_cost_s = 0.0
        drafts = [min(c, self.s.max_k) for c in caps]
        counts = [self._probe_counts.get(r, 0) for r in request_ids]
        idle = within_budget(idle, counts, drafts, self.s.probe_drafts, at_least_one=True)
        for r, i in zip(request_ids, idle):
            if i:
                self._probe_counts[r] = self._probe_counts.get(r, 0) + 1
        self._probed = True
        return [d if i else k for k, d, i in zip(ks, drafts, idle)]

    def _probe_due(self, leased_steps: int = 0, leased_s: float = 0.0) -> bool:
        """This step's held requests probe (module docstring): `probe_interval` steps
        with one held, and the time since the last probe 1 / `probe_budget` times its
        cost (counting a running lease's steps and seconds, not yet handed over)."""
        return (self._since_probe + leased_steps + 1 >= self.probe_interval
                and (self._elapsed_s + leased_s) * self.s.probe_budget
                >= self._probe_cost_s)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self._match_of.pop(request_id, None)
        self._previous.pop(request_id, None)
        self._probe_counts.pop(request_id, None)
