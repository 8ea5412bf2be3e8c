"""How the adaptive policy learns about requests it holds at K = 0, and what it skips
while nothing can change: probes (held requests draft together, spaced by a time budget),
shadow drafts (prompt lookup's unverified proposals scored against the emitted tokens) and
idle leases (steps on which the engine does not consult the policy)."""

from __future__ import annotations

import logging
import math

from specmoe.engine.stats import EngineStats
from specmoe.request import Request
from specmoe.spec_decode.adaptive.settings import AdaptiveSettings
from specmoe.spec_decode.adaptive.solve import Pending, resolve_pending
from specmoe.spec_decode.policy import StepReport, own_k
from specmoe.spec_decode.proposer import ProposeRequest
from specmoe.spec_decode.shadow import ShadowDrafts, ShadowOutcome

logger = logging.getLogger(__name__)


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


def shadow_drafts(every: int, proposer) -> ShadowDrafts | None:
    """The shadow drafts `every` asks for (0: none), where the proposer is stateless (a
    shadow of a draft model would cost its forwards and catch-ups).

    Raises:
        ValueError: shadow drafts asked for with a proposer that keeps state.
    """
    if not every:
        return None
    if not getattr(proposer, "stateless", False):
        raise ValueError(f"shadow drafts (shadow_every={every}) need a stateless proposer "
                         f"such as prompt lookup, not "
                         f"{getattr(proposer, 'name', type(proposer).__name__)!r}")
    return ShadowDrafts(every)


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


class Exploration:
    """Probes, shadows and leases (a part of `AdaptivePolicy`, whose state it reads and
    writes)."""

    def _init_exploration(self, settings: AdaptiveSettings, proposer) -> None:
        self._since_probe = 0  # steps with a request held at K = 0 since the last probe
        self.probe_interval = settings.probe_every  # grows while probes find nothing
        self._probed = False  # the previous step probed
        self._probe_counts: dict[str, int] = {}  # probes each running request was in
        self._probe_cost_s = 0.0  # the last probe's drafting and verification seconds
        self._elapsed_s = 0.0  # seconds of forwards and drafting since the last probe
        self.lease: IdleLease | None = None
        self.shadow = shadow_drafts(settings.shadow_every, proposer)

    def _lease_holds(self, report: StepReport, stats: EngineStats) -> bool:
        """Whether the step just run is one the lease covers (`IdleLease`): every scheduled
        request decoded one token, none finished or failed, and they are the leased ones.
        Otherwise the lease ends, its error recorded in `stats`."""
        reqs, windows = report.requests, report.windows
        steady = (not report.any_failed and len(windows) == len(reqs) == sum(windows)
                  and not any(req.is_finished for req in reqs))
        if self.leased_step([req.request_id for req in reqs] if steady else None,
                            report.seconds):
            return True
        error = self.end_lease()
        if error is not None:
            stats.record_step_time_error(error)
        return False

    def _shadow_propose(self, live: list[Request], ks: dict[str, int],
                        stats: EngineStats) -> None:
        """Shadow drafts (`spec_decode.shadow`) for the requests held at K = 0 that may
        draft and are due one: proposed now, resolved by `_resolve_shadows` as the tokens
        come. A proposer that raises only costs the shadows (no request fails for one)."""
        asks = [ProposeRequest(req.request_id, req.all_token_ids,
                               min(own_k(req, self.max_model_len), self.s.max_k), req.params,
                               None)
                for req in live if ks[req.request_id] == 0
                and self.shadow.due(req.request_id, req.num_tokens)]
        asks = [ask for ask in asks if ask.max_num_draft_tokens > 0]
        if not asks:
            return
        try:
            proposals = self.proposer.propose(asks)
        except Exception:  # noqa: BLE001 - a shadow informs the policy, nothing more
            logger.debug("shadow proposal failed", exc_info=True)
            return
        for ask, proposal in zip(asks, proposals):
            outcome = self.shadow.issue(ask.request_id, len(ask.context),
                                        ask.max_num_draft_tokens,
                                        proposal.token_ids, proposal.match_length)
            if outcome is not None:
                self._count_shadow(outcome, len(live), stats)

    def _resolve_shadows(self, reqs: list[Request], stats: EngineStats) -> None:
        """Learn from the open shadows the step's emitted tokens resolve."""
        base_rows = None  # the requests going on: counted once, where a shadow resolves
        for req in reqs:
            outcome = self.shadow.resolve(req.request_id, req.all_token_ids)
            if outcome is not None:
                if base_rows is None:
                    base_rows = sum(not r.is_finished for r in reqs)
                self._count_shadow(outcome, base_rows, stats)

    def _count_shadow(self, outcome: ShadowOutcome, base_rows: int,
                      stats: EngineStats) -> None:
        stats.num_shadow_draft_tokens += outcome.drafted
        stats.num_shadow_accepted_tokens += outcome.accepted
        self.observe_shadow(outcome, base_rows)

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

    def _shadow_recheck(self, batch: int) -> int:
        """Steps a batch of `batch` requests kept off is held while shadow drafts inform
        its estimates: as many as keep the solves within `recheck_budget` of the steps'
        predicted time, at least `shadow_every` (a shadow's drafts take that many steps to
        be reached), at most `recheck_every_max`."""
        step_s = self.step_time.predict_one(batch, self.unique_fraction([1] * batch))
        steps = (self.s.recheck_every_max if not step_s else
                 math.ceil(self._solve_s / (self.s.recheck_budget * step_s)))
        return int(min(max(steps, self.s.shadow_every), self.s.recheck_every_max))

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
        pending = resolve_pending(pending)
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
        """This step's held requests probe (docs/adaptive.md, "Hysteresis and probes"):
        `probe_interval` steps with one held, and the time since the last probe
        1 / `probe_budget` times its cost (counting a running lease's steps and seconds,
        not yet handed over)."""
        return (self._since_probe + leased_steps + 1 >= self.probe_interval
                and (self._elapsed_s + leased_s) * self.s.probe_budget
                >= self._probe_cost_s)
