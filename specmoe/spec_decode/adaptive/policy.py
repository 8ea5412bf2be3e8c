"""`AdaptivePolicy`: before each step, every running request's K in 0..its own K is chosen
to maximise the batch's expected tokens per second, from draft acceptance measured per
request and position and step times measured on the running engine (docs/adaptive.md: each
mechanism, why it is there and the results that showed it; the choice in
`spec_decode.choice`, the time models in `spec_decode.time_models`)."""

from __future__ import annotations

import torch

from specmoe.engine.stats import EngineStats
from specmoe.request import Request
from specmoe.spec_decode.adaptive.estimators import Estimation
from specmoe.spec_decode.adaptive.exploration import Exploration
from specmoe.spec_decode.adaptive.settings import AdaptiveSettings
from specmoe.spec_decode.adaptive.solve import Solve
from specmoe.spec_decode.policy import (DraftReport, ScheduleView, SpeculationPolicy,
                                        StaticPolicy, StepReport, own_k)
from specmoe.spec_decode.routing_overlap import RoutingSampler

NO_LIMIT = 2**31 - 1


class _ForwardWatch:
    """The context `AdaptivePolicy.watch_forward` returns (one per policy, reused): samples
    the forward's routing (`RoutingSampler`) on the steps the sampler picks."""

    __slots__ = ("sampler", "windows", "sampled", "overlap")

    def __init__(self, sampler: RoutingSampler) -> None:
        self.sampler, self.windows, self.sampled, self.overlap = sampler, [], False, None

    def __enter__(self) -> None:
        self.overlap = None
        self.sampled = self.sampler.begin(max(self.windows), sum(self.windows))

    def __exit__(self, *exc) -> None:
        if self.sampled:
            self.overlap = self.sampler.end(self.windows)


class AdaptivePolicy(Solve, Exploration, Estimation, SpeculationPolicy):
    """K per request and step (module docstring), behind the `SpeculationPolicy` seam.

    Args:
        settings: see `AdaptiveSettings`.
        max_model_len: the target's context limit (no request drafts past it).
        proposer: the engine's proposer, asked for shadow drafts (`shadow_every`) and for
            each request's catch-up (`pending_tokens`, a draft model's).
        model: the target model, whose MoE blocks' routing is sampled (None: none).
        disable_by_batch_size: as `StaticPolicy`'s (None: no limit).

    Raises:
        ValueError: shadow drafts asked for with a proposer that keeps state.
    """

    def __init__(self, settings: AdaptiveSettings, max_model_len: int = NO_LIMIT,
                 proposer=None, model: torch.nn.Module | None = None,
                 disable_by_batch_size: int | None = None) -> None:
        super().__init__(max_model_len, settings.max_k)
        self.s, self.proposer = settings, proposer
        self._init_estimation(settings)
        self._init_exploration(settings, proposer)
        self._init_solve(settings)
        self._pause = StaticPolicy(max_model_len, settings.max_k, disable_by_batch_size)
        self.routing_sampler = RoutingSampler(model if settings.is_moe else None)
        self._watch = _ForwardWatch(self.routing_sampler)
        self._leased = False  # the step just observed was leased
        self._catch_ups: list[int] | None = None  # of the requests asked to draft next

    def before_schedule(self, view: ScheduleView, stats: EngineStats) -> None:
        """Where the step will also compute prompt chunks (a request waiting, or one whose
        prompt did not fit the last step), cut the drafts the decoding requests proposed
        for a decode-only step (`beside_prompts`). Not while a lease holds every request
        at K = 0; skipped where no request holds drafts or no prompt is due."""
        if self.lease is not None or not any(req.draft for req in view.running):
            return
        decoding = [req for req in view.running
                    if req.num_tokens - req.num_computed_tokens == 1]
        if not view.waiting and len(decoding) == len(view.running):
            return
        kept = self.beside_prompts([req.request_id for req in decoding],
                                   [len(req.draft) for req in decoding], len(decoding),
                                   view.prompt_rows_ahead(len(decoding)))
        for req, k in zip(decoding, kept):
            stats.num_trimmed_draft_tokens += req.draft.truncate(k)

    def watch_forward(self, windows: list[int]) -> _ForwardWatch:
        self._watch.windows = windows
        return self._watch

    def observe(self, report: StepReport, stats: EngineStats) -> None:
        """The step's acceptance, routing overlap and (off the sampled steps) forward time;
        the shadows its tokens resolve. A leased step (`IdleLease`) is only counted."""
        stats.realized_gain_factors = self.realized.factors
        self._leased = self.lease is not None and self._lease_holds(report, stats)
        if self._leased:
            return
        accepted = report.num_accepted
        for req, drafted in zip(report.requests, report.num_draft_tokens):
            if drafted and req.request_id in accepted:
                self.observe_verified(req.request_id, drafted, accepted[req.request_id])
        if self._watch.overlap is not None:
            self.observe_overlap(self._watch.overlap)
        if not self._watch.sampled:  # a sampled step ran off the fused path: not timed
            error = self.observe_step(sum(report.windows), report.seconds, report.windows)
            if error is not None:
                stats.record_step_time_error(error)
        if self.shadow is not None:
            self._resolve_shadows(report.requests, stats)

    def draft_lengths(self, live: list[Request], num_running: int, stats: EngineStats
                      ) -> dict[str, int]:
        """`choose` over the requests going on, within `disable_by_batch_size`; a batch
        held off is leased its next steps (`grant_lease`), and shadows are proposed."""
        if self._leased:  # every request held at K = 0 again, nothing consulted
            stats.num_spec_paused_steps += 1
            stats.record_draft_ks((0,), len(live))
            return {}
        if self._pause.cap(num_running) == 0 and num_running:
            return self._pause.draft_lengths(live, num_running, stats)
        own = {req.request_id: own_k(req, self.max_model_len) for req in live}
        ks = self.choose(list(own), list(own.values()), len(live),
                         lambda: self._pending(live),
                         lambda: [req.num_tokens_left for req in live]) if live else own
        if live and not any(ks.values()):
            stats.num_spec_paused_steps += 1
            self.grant_lease(list(own))
        stats.record_draft_ks(ks.values())
        if self.shadow is not None:
            self._shadow_propose(live, ks, stats)
        self._catch_ups = self._pending([req for req in live if ks[req.request_id]])
        return ks

    def proposed(self, report: DraftReport, stats: EngineStats) -> list[int]:
        """Times the drafting call and cuts prompt-lookup proposals by their match length
        (`trim`); learns how often each asked slot was filled."""
        self.observe_draft(max(report.num_asked), report.seconds, self._catch_ups)
        keep = self.trim(report.request_ids, report.num_proposed, report.match_lengths,
                         report.num_live)
        stats.num_trimmed_draft_tokens += sum(report.num_proposed) - sum(keep)
        for rid, asked, n, failed in zip(report.request_ids, report.num_asked, keep,
                                         report.failed):
            if not failed:
                self.observe_proposed(rid, asked, n)
        return keep

    def _pending(self, reqs: list[Request]) -> list[int] | None:
        """Per request, the tokens the draft model's cache lacks (its catch-up), where the
        proposer keeps a cache (None: it does not, or no request)."""
        pending = getattr(self.proposer, "pending_tokens", None)
        if pending is None or not reqs:
            return None
        return [pending(req.request_id, req.num_tokens) for req in reqs]

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
        self._match_of.pop(request_id, None)
        self._previous.pop(request_id, None)
        self._probe_counts.pop(request_id, None)
        if self.shadow is not None:
            self.shadow.forget(request_id)
