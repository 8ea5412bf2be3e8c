"""The engine core: continuous batching with batched speculative decoding, one `step()` at a time.

One step (docs/architecture.md, "One speculative step"): the scheduler schedules every running
request's gap between computed and verified tokens plus its drafts; the target runs one forward
over the whole batch through the paged KV cache; each request that reached its last token is
verified by rejection sampling (its accepted drafts plus one recovered or bonus token are
appended, earliest stop first); the scheduler rolls each request's computed tokens back past its
rejected drafts; the proposer drafts the next K for every request still running, in one batch.

K = 0 (no proposer, or a request that turns speculation off) takes the same path with no
drafts, so outputs with and without speculation come from the same sampling code.
"""

from __future__ import annotations

import logging
import time

import torch

from specmoe.config import SchedulerConfig, batch_size_table_k
from specmoe.engine.output_processor import OutputProcessor
from specmoe.engine.scheduler import ScheduledRequest, Scheduler
from specmoe.engine.stats import EngineStats
from specmoe.engine.isolation import run_isolated
from specmoe.engine.verification import VerifyResult, VerifyRow, verify_rows
from specmoe.outputs import TokenLogprob
from specmoe.request import Request
from specmoe.sample.ops import compute_logprobs
from specmoe.spec_decode.adaptive import AdaptivePolicy
from specmoe.spec_decode.routing_overlap import RoutingSampler
from specmoe.spec_decode.proposer import ProposeRequest
from specmoe.spec_decode.shadow import ShadowDrafts, ShadowOutcome
from specmoe.spec_decode.time_models import call_rows
from specmoe.utils.threads import make_thread_governor
from specmoe.worker.model_runner import ModelRunner, SequenceInput

logger = logging.getLogger(__name__)


class NullStepObserver:
    """Observes nothing (the default `EngineCore.step_observer`). An observer sees each step's
    schedule and verification outcome, e.g. to tag the rows of the step's forward
    (`specmoe.analysis.routing_trace.RoutingCapture`)."""

    def on_step_verified(self, scheduled: list[ScheduledRequest],
                         requests: dict[str, Request], num_accepted: dict[str, int]) -> None:
        """Called once per step after verification, before finished requests leave.

        Args:
            scheduled: the step's requests in forward order; the forward's token rows are
                their `token_ids`, concatenated.
            requests: the scheduler's requests by id (all scheduled ones are present).
            num_accepted: per request that sampled, its drafts accepted and kept (drafts
                accepted by verification but cut by an earlier stop are not kept); absent
                for prompt chunks that did not sample.
        """


class EngineCore:
    """Runs many requests at once on a target model with an optional proposer.

    Args:
        target: the target model runner.
        proposer: a Proposer, or None for no speculation.
        processor: finish logic and detokenisation.
        scheduler_config: batching and KV cache settings.
        num_kv_blocks: blocks of the target's paged KV cache.
        num_speculative_tokens: default K of requests that do not set their own (ignored
            without a proposer).
        disable_by_batch_size: no request drafts after a step that leaves at least this many
            requests running (None: no limit); see `SpeculativeConfig`.
        batch_size_table: `config.parse_batch_size_table` rows: after each step, requests
            draft at most the K of the range holding the number of running requests (None:
            their own K).
        policy: an `AdaptivePolicy` choosing each request's K per step (None: their own K).
    """

    def __init__(self, target: ModelRunner, proposer, processor: OutputProcessor,
                 scheduler_config: SchedulerConfig, num_kv_blocks: int,
                 num_speculative_tokens: int, disable_by_batch_size: int | None = None,
                 batch_size_table: tuple[tuple[int, int, int], ...] | None = None,
                 policy: AdaptivePolicy | None = None) -> None:
        self.target = target
        self.proposer = proposer
        self.processor = processor
        self.default_k = num_speculative_tokens if proposer is not None else 0
        self.disable_by_batch_size = disable_by_batch_size
        self.batch_size_table = batch_size_table
        self.policy = policy if proposer is not None else None
        self.shadow = _shadow_drafts(self.policy, proposer)
        self.routing_sampler = (RoutingSampler(target.model)
                                if self.policy is not None and self.policy.s.is_moe else None)
        self.kv_cache = target.new_paged_cache(num_kv_blocks, scheduler_config.block_size)
        self.scheduler = Scheduler(scheduler_config, num_kv_blocks, target.max_model_len)
        self.reset_stats()
        # Fewer threads while other processes hold cores (specmoe/utils/threads.py).
        self.thread_governor = make_thread_governor(torch.set_num_threads,
                                                    torch.get_num_threads())
        self._generators: dict[str, torch.Generator] = {}
        self._draft_probs: dict[str, torch.Tensor | None] = {}
        self.step_observer = NullStepObserver()
        self._failed: list[Request] = []  # this step's requests failed alone (`_fail`)

    def add_request(self, req: Request, generator: torch.Generator) -> None:
        """Queue a request; `generator` drives all of its random draws.

        Raises:
            ValueError: duplicate id, or a request that cannot fit in the KV cache.
        """
        k = req.params.num_speculative_tokens
        req.num_speculative_tokens = (self.default_k if k is None or self.proposer is None
                                      else k)
        self.scheduler.add_request(req)
        self._generators[req.request_id] = generator
        req.metrics.arrival_time = time.perf_counter()

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request now (finish_reason "abort"); its blocks return to the pool. None if
        the id is unknown or already finished."""
        req = self.scheduler.abort_request(request_id)
        if req is not None:
            req.finish_reason = req.finish_reason or "abort"
            self._forget(request_id)
        return req

    def reset_stats(self) -> None:
        """Zero the counters (`stats`); its realized gain factors stay the adaptive policy's
        own dict (state, not counters: nothing to copy per step)."""
        self.stats = EngineStats()
        if self.policy is not None:
            self.stats.realized_gain_factors = self.policy.realized.factors

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it, including those whose
        input made the step's forward, verification or proposal fail: they alone fail
        (finish_reason "error", `Request.error` says why) and the others go on
        (`engine.isolation`).

        Raises:
            Exception: what the step raised when it was no single request's fault (every
                request fails alone too, or the step held one request).
            RuntimeError: requests are waiting but none can be scheduled (cannot happen with
                the admission checks of `Scheduler.add_request`; guards against a hang).
        """
        self.thread_governor.update()
        if self.policy is not None and self.policy.lease is None:  # leased: no drafts
            self._cut_beside_prompts()
        out = self.scheduler.schedule()
        for request_id in out.preempted_request_ids:
            self._drop_drafts(request_id)
        if not out.scheduled:
            if self.has_unfinished_requests:
                raise RuntimeError("no request could be scheduled; the KV cache is too small")
            return []
        self._failed = []
        windows = [len(s.token_ids) for s in out.scheduled]
        sampled_routing = self.routing_sampler is not None and self.routing_sampler.begin(
            max(windows), sum(windows))
        t0 = time.perf_counter()
        try:
            logits = self._forward(out.scheduled)
        finally:
            overlap = self.routing_sampler.end(windows) if sampled_routing else None
        sampled = [s for s in out.scheduled if s.request_id in logits]
        reqs = [self.scheduler.requests[s.request_id] for s in sampled]
        num_rejected, num_accepted, num_emitted = self._verify(
            sampled, reqs, [logits[s.request_id] for s in sampled])
        self.step_observer.on_step_verified(out.scheduled, self.scheduler.requests, num_accepted)
        verify_time = time.perf_counter() - t0
        leased = self.policy is not None and self._leased_step(reqs, windows, verify_time)
        if not leased:
            self._observe_policy(sampled, num_accepted, windows, verify_time, overlap,
                                 timed=not sampled_routing)
        verified = [req for s, req in zip(sampled, reqs) if s.num_draft_tokens]
        for req in verified:
            req.spec_stats.verify_time_s += verify_time
        if verified:
            self.stats.spec.verify_time_s += verify_time
        self.stats.num_generation_tokens += sum(num_emitted.values())
        finished = self.scheduler.update_from_output(out, num_rejected)
        if self.shadow is not None and not leased:
            self._resolve_shadows(reqs)
        for req in finished:
            self._forget(req.request_id)
            self.stats.spec.merge(req.spec_stats, times=False)
            req.metrics.decode_time_s = (time.perf_counter() - req.metrics.arrival_time
                                         - req.metrics.first_token_time_s)
        live = [req for req in reqs if not req.is_finished]
        if leased:  # every request held at K = 0 again, the policy not consulted
            self.stats.num_spec_paused_steps += 1
            self.stats.record_draft_ks((0,), len(live))
            self.stats.record_step(out.stats)
            return finished + self._failed
        cap = self._draft_cap()
        ks = self._draft_ks(live, cap)
        if cap == 0 or (live and self.policy is not None and not any(ks.values())):
            self.stats.num_spec_paused_steps += 1
            if cap is None:
                self.policy.grant_lease([req.request_id for req in live])
        if self.proposer is not None:
            self.stats.record_draft_ks(ks.values())
        if self.shadow is not None and cap is None:
            self._shadow_propose(live, ks)
        if any(ks.values()):
            self._propose(live, ks)
        self.stats.record_step(out.stats)
        return finished + self._failed

    def _forward(self, scheduled: list[ScheduledRequest]) -> dict[str, torch.Tensor]:
        """One target forward over the batch: per request that samples, its [num_logits,
        vocab_size] logits. A request whose input makes the forward fail is failed alone."""
        results = run_isolated(self._execute, lambda s: self._execute([s])[0], scheduled)
        logits = {}
        for s, result in zip(scheduled, results):
            if isinstance(result, Exception):
                self._fail(self.scheduler.requests[s.request_id], result)
            elif result is not None:
                logits[s.request_id] = result
        return logits

    def _execute(self, scheduled: list[ScheduledRequest]) -> list[torch.Tensor | None]:
        logits = self.target.execute(self.kv_cache, [
            SequenceInput(s.token_ids, s.start_pos, s.block_ids, s.num_logits)
            for s in scheduled])  # [sum of num_logits, vocab_size]
        sizes = [s.num_logits for s in scheduled if s.num_logits]
        pieces = iter(logits.split(sizes) if sizes else ())
        return [next(pieces) if s.num_logits else None for s in scheduled]

    def _verify(self, sampled: list[ScheduledRequest], reqs: list[Request],
                logits: list[torch.Tensor]
                ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Rejection-sample every request that reached its last token, append what it
        emits, and return, per request id, its rejected drafts, its accepted drafts that
        were kept, and the tokens it emitted. A request whose verification or output
        processing fails is failed alone (its neighbours' draws are unchanged)."""
        rows = [self._verify_row(s, req, rows) for s, req, rows in zip(sampled, reqs, logits)]
        num_rejected, num_accepted, num_emitted = {}, {}, {}
        for s, req, row, result in zip(sampled, reqs, rows, self._verify_isolated(rows)):
            try:
                if isinstance(result, Exception):
                    raise result
                num_kept = self._emit(req, row, result)
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                self._fail(req, exc)
                continue
            num_emitted[s.request_id] = num_kept
            num_accepted[s.request_id] = min(result.num_accepted, num_kept)
            req.spec_stats.record(s.num_draft_tokens, num_accepted[s.request_id])
            if s.num_draft_tokens:
                req.spec_stats.num_emitted_tokens += num_kept
            num_rejected[s.request_id] = s.num_draft_tokens - result.num_accepted
        return num_rejected, num_accepted, num_emitted

    def _verify_isolated(self, rows: list[VerifyRow]) -> list[VerifyResult | Exception]:
        """`verify_rows`, retried row by row if it raises, with every sampled row's generator
        first put back where it was, so each row draws what it would have drawn."""
        states = [(r.generator, r.generator.get_state()) for r in rows
                  if r.generator is not None and not r.params.is_greedy]

        def restore() -> None:
            for generator, state in states:
                generator.set_state(state)
        return run_isolated(verify_rows, lambda row: verify_rows([row])[0], rows, restore)

    def _emit(self, req: Request, row: VerifyRow, result: VerifyResult) -> int:
        """Append a verification's tokens (and logprobs) to the request; returns the number
        kept (an earlier stop cuts the rest)."""
        if not req.output_token_ids:
            req.metrics.first_token_time_s = time.perf_counter() - req.metrics.arrival_time
            req.metrics.prefill_time_s = req.metrics.first_token_time_s
        logprobs = _logprobs(req, row.logits, result.token_ids)
        return self.processor.append(req, result.token_ids, logprobs)

    def _fail(self, req: Request, exc: Exception) -> None:
        """Drop a request whose input made part of the step fail (finish_reason "error");
        its blocks return to the pool and what it generated so far is kept."""
        logger.warning("request %s failed alone and is dropped: %s: %s", req.request_id,
                       type(exc).__name__, exc)
        self.scheduler.abort_request(req.request_id)
        self._forget(req.request_id)
        req.error = f"{type(exc).__name__}: {exc}"
        req.finish_reason = "error"
        try:
            req.text = self.processor.decode(req.output_token_ids)
        except Exception:  # noqa: BLE001 - the text may be what failed
            logger.exception("decoding the output of failed request %s", req.request_id)
        self._failed.append(req)

    def _verify_row(self, s: ScheduledRequest, req: Request, logits: torch.Tensor) -> VerifyRow:
        probs = self._draft_probs.pop(s.request_id, None)
        drafts = s.token_ids[len(s.token_ids) - s.num_draft_tokens:]
        if probs is not None:
            probs = probs[:s.num_draft_tokens]  # the scheduler may have cut drafts
        return VerifyRow(logits, drafts, probs, req.params, self._generators[s.request_id])

    def _draft_cap(self) -> int | None:
        """The most tokens a request drafts for the next step, from the number of running
        requests: 0 while speculation pauses (`disable_by_batch_size`, or K=0 in the
        batch-size table), the table's K, or None (each request's own K). A paused draft
        model catches up on the skipped tokens when drafting resumes."""
        running = len(self.scheduler.running)
        if self.proposer is None or not running:
            return None
        limit = self.disable_by_batch_size
        if limit is not None and running >= limit:
            return 0
        if self.batch_size_table is not None:
            return batch_size_table_k(self.batch_size_table, running)
        return None

    def _draft_ks(self, live: list[Request], cap: int | None) -> dict[str, int]:
        """Per request that may draft for the next step, how many tokens it drafts: its own
        K (`_own_k`) within the pause or table `cap`, else the adaptive policy's choice."""
        own = {req.request_id: self._own_k(req) for req in live}
        if cap is not None:
            return {rid: min(k, cap) for rid, k in own.items()}
        if self.policy is None or not live:
            return own
        return self.policy.choose(list(own), list(own.values()), len(live),
                                  lambda: self._pending_tokens(live),
                                  lambda: [req.num_tokens_left for req in live])

    def _cut_beside_prompts(self) -> None:
        """Before scheduling: where the step will also compute prompt chunks (a request
        waiting, or one whose prompt did not fit the last step), let the adaptive policy
        cut the drafts the decoding requests proposed, which it chose for a decode-only
        step (`AdaptivePolicy.beside_prompts`). Not called while the policy leases the
        steps (every request at K = 0); skipped where no request holds drafts or no
        prompt is due, without counting the rows."""
        scheduler = self.scheduler
        if not any(req.spec_token_ids for req in scheduler.running):
            return
        decoding = [req for req in scheduler.running
                    if req.num_tokens - req.num_computed_tokens == 1]
        if not scheduler.waiting and len(decoding) == len(scheduler.running):
            return
        drafts = [len(req.spec_token_ids) for req in decoding]
        prompt_rows = scheduler.prompt_rows_ahead(len(decoding))
        kept = self.policy.beside_prompts([req.request_id for req in decoding], drafts,
                                          len(decoding), prompt_rows)
        for req, n, k in zip(decoding, drafts, kept):
            if k < n:
                req.spec_token_ids = req.spec_token_ids[:k]
                self.stats.num_trimmed_draft_tokens += n - k

    def _leased_step(self, reqs: list[Request], windows: list[int], seconds: float) -> bool:
        """Whether this step is one the adaptive policy leased (`IdleLease`): every
        scheduled request decoded one token, none finished or failed, and they are the
        leased ones. The lease is checked (and ended where it does not hold) only while
        the policy has one."""
        if self.policy.lease is None:
            return False
        steady = (not self._failed and len(windows) == len(reqs) == sum(windows)
                  and not any(req.is_finished for req in reqs))
        if self.policy.leased_step([req.request_id for req in reqs] if steady else None,
                                   seconds):
            return True
        error = self.policy.end_lease()
        if error is not None:
            self.stats.record_step_time_error(error)
        return False

    def _pending_tokens(self, reqs: list[Request]) -> list[int] | None:
        """Per request, the tokens the draft model's cache lacks (its catch-up), where an
        adaptive policy runs and the proposer keeps a cache."""
        pending = getattr(self.proposer, "pending_tokens", None)
        if pending is None or self.policy is None:
            return None
        return [pending(req.request_id, req.num_tokens) for req in reqs]

    def _observe_policy(self, sampled: list[ScheduledRequest], num_accepted: dict[str, int],
                        windows: list[int], seconds: float,
                        overlap: float | None, timed: bool) -> None:
        """Feed the adaptive policy what the step verified, its routing overlap (a sampled
        MoE step) and, unless that step ran off the fused path, its time (`windows`: the
        rows each scheduled request computed)."""
        if self.policy is None:
            return
        for s in sampled:
            if s.num_draft_tokens and s.request_id in num_accepted:
                self.policy.observe_verified(s.request_id, s.num_draft_tokens,
                                             num_accepted[s.request_id])
        if overlap is not None:
            self.policy.observe_overlap(overlap)
        if not timed:
            return
        error = self.policy.observe_step(sum(windows), seconds, windows)
        if error is not None:
            self.stats.record_step_time_error(error)

    def _own_k(self, req: Request) -> int:
        """The most tokens `req` may draft next: its K, within max_tokens and the context."""
        return max(0, min(req.num_speculative_tokens,
                          req.num_tokens_left - 1,
                          self.target.max_model_len - req.num_tokens - 1))

    def _propose(self, reqs: list[Request], ks: dict[str, int]) -> None:
        """Draft `ks[request_id]` next tokens of every request that speculates, in one
        batch."""
        asks = []
        for req in reqs:
            k = ks[req.request_id]
            if k > 0:
                asks.append((req, self._ask(req, k)))
        if not asks:
            return
        pending = self._pending_tokens([req for req, _ in asks])
        t0 = time.perf_counter()
        proposals = run_isolated(self.proposer.propose,
                                 lambda ask: self.proposer.propose([ask])[0],
                                 [ask for _, ask in asks])
        draft_time = time.perf_counter() - t0
        self.stats.spec.draft_time_s += draft_time
        if self.policy is not None:
            # the calls' rows feed only the drafting time model of draft_cost="rows"
            rows = None if pending is None or not self.policy.s.draft_rows_model else (
                call_rows([ask.num_tokens for _, ask in asks], pending))
            self.policy.observe_draft(max(ask.num_tokens for _, ask in asks), draft_time,
                                      rows, pending)
        keep = self._trimmed(reqs, asks, proposals)
        for (req, ask), proposal, n in zip(asks, proposals, keep):
            if isinstance(proposal, Exception):
                self._fail(req, proposal)
                continue
            if self.policy is not None:
                self.policy.observe_proposed(req.request_id, ask.num_tokens, n)
            req.spec_token_ids = proposal.token_ids[:n]
            self._draft_probs[req.request_id] = proposal.probs
            req.spec_stats.draft_time_s += draft_time

    def _trimmed(self, reqs: list[Request], asks: list, proposals: list) -> list[int]:
        """Per proposal, the drafts verified: the adaptive policy cuts prompt-lookup
        proposals by their match length (`AdaptivePolicy.trim`)."""
        lengths = [0 if isinstance(p, Exception) else len(p.token_ids) for p in proposals]
        if self.policy is None:
            return lengths
        keep = self.policy.trim([req.request_id for req, _ in asks], lengths,
                                [0 if isinstance(p, Exception) else p.match_length
                                 for p in proposals], len(reqs))
        self.stats.num_trimmed_draft_tokens += sum(lengths) - sum(keep)
        return keep

    def _shadow_propose(self, live: list[Request], ks: dict[str, int]) -> None:
        """Shadow drafts (`spec_decode.shadow`) for the requests held at K = 0 that may
        draft and are due one: proposed now, resolved by `_resolve_shadows` as the tokens
        come. A proposer that raises only costs the shadows (no request fails for one)."""
        asks = [self._ask(req, min(self._own_k(req), self.policy.s.max_k))
                for req in live if ks[req.request_id] == 0
                and self.shadow.due(req.request_id, req.num_tokens)]
        asks = [ask for ask in asks if ask.num_tokens > 0]
        if not asks:
            return
        try:
            proposals = self.proposer.propose(asks)
        except Exception:  # noqa: BLE001 - a shadow informs the policy, nothing more
            logger.debug("shadow proposal failed", exc_info=True)
            return
        for ask, proposal in zip(asks, proposals):
            outcome = self.shadow.issue(ask.request_id, len(ask.context), ask.num_tokens,
                                        proposal.token_ids, proposal.match_length)
            if outcome is not None:
                self._observe_shadow(outcome, len(live))

    def _resolve_shadows(self, reqs: list[Request]) -> None:
        """Feed the policy the open shadows the step's emitted tokens resolve."""
        base_rows = None  # the requests going on: counted once, where a shadow resolves
        for req in reqs:
            outcome = self.shadow.resolve(req.request_id, req.all_token_ids)
            if outcome is not None:
                if base_rows is None:
                    base_rows = sum(not r.is_finished for r in reqs)
                self._observe_shadow(outcome, base_rows)

    def _observe_shadow(self, outcome: ShadowOutcome, base_rows: int) -> None:
        """Count a resolved shadow and hand it to the policy."""
        self.stats.num_shadow_draft_tokens += outcome.drafted
        self.stats.num_shadow_accepted_tokens += outcome.accepted
        self.policy.observe_shadow(outcome, base_rows)

    def _ask(self, req: Request, k: int) -> ProposeRequest:
        """What the proposer is asked for `req`: k tokens continuing its context."""
        return ProposeRequest(req.request_id, req.all_token_ids, k, req.params,
                              self._generators[req.request_id])

    def _drop_drafts(self, request_id: str) -> None:
        self._draft_probs.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.free(request_id)

    def _forget(self, request_id: str) -> None:
        self._drop_drafts(request_id)
        if self.policy is not None:
            self.policy.forget(request_id)
        if self.shadow is not None:
            self.shadow.forget(request_id)
        self._generators.pop(request_id, None)


def _shadow_drafts(policy: AdaptivePolicy | None, proposer) -> ShadowDrafts | None:
    """The shadow drafts an adaptive policy asks for (`shadow_every`), where the proposer
    is stateless (a shadow of a draft model would cost its forwards and catch-ups).

    Raises:
        ValueError: shadow drafts asked for with a proposer that keeps state.
    """
    if policy is None or not policy.s.shadow_every:
        return None
    if not getattr(proposer, "stateless", False):
        raise ValueError(f"shadow drafts (shadow_every={policy.s.shadow_every}) need a "
                         f"stateless proposer such as prompt lookup, not "
                         f"{getattr(proposer, 'name', type(proposer).__name__)!r}")
    return ShadowDrafts(policy.s.shadow_every)


def _logprobs(req: Request, logits: torch.Tensor, tokens: list[int]) -> list[TokenLogprob] | None:
    num_top = req.params.logprobs
    if num_top is None:
        return None
    logits = logits[:len(tokens)]
    ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    token_lp, top_ids, top_lp = compute_logprobs(logits, ids, num_top)
    token_lp, top_ids, top_lp = token_lp.tolist(), top_ids.tolist(), top_lp.tolist()
    return [TokenLogprob(t, token_lp[i], list(zip(top_ids[i], top_lp[i])))
            for i, t in enumerate(tokens)]
