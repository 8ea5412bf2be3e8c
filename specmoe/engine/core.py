"""The engine core: continuous batching with batched speculative decoding, one `step()` at a time.

One step (docs/architecture.md, "One speculative step"): the scheduler schedules every running
request's gap between computed and verified tokens plus its drafts; the target runs one forward
over the whole batch through the paged KV cache; each request that reached its last token is
verified by rejection sampling (its accepted drafts plus one recovered or bonus token are
appended, earliest stop first); the scheduler rolls each request's computed tokens back past its
rejected drafts; the proposer drafts the next K for every request still running, in one batch.
How many each request drafts is the `SpeculationPolicy`'s to say, at the fixed points of a
step its interface names (`spec_decode.policy`).

K = 0 (no proposer, or a request that turns speculation off) takes the same path with no
drafts, so outputs with and without speculation come from the same sampling code.
"""

from __future__ import annotations

import logging
import time

import torch

from specmoe.config import KernelConfig, SchedulerConfig
from specmoe.engine.isolation import run_isolated
from specmoe.engine.output_processor import OutputProcessor
from specmoe.engine.scheduler import ScheduledRequest, Scheduler
from specmoe.engine.stats import EngineStats
from specmoe.engine.verification import VerifyResult, VerifyRow, verify_rows
from specmoe.outputs import TokenLogprob
from specmoe.request import DraftState, Request
from specmoe.sample.ops import compute_logprobs
from specmoe.spec_decode.policy import DraftReport, SpeculationPolicy, StepReport
from specmoe.spec_decode.proposer import Proposer, ProposeRequest
from specmoe.utils.threads import make_thread_governor
from specmoe.worker.kernel_switches import KernelSwitches
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
    """Runs many requests at once on a target model with a proposer and a speculation policy.

    Args:
        target: the target model runner.
        proposer: a Proposer (`spec_decode.proposer.NoProposer` for no speculation).
        processor: finish logic and detokenisation.
        scheduler_config: batching and KV cache settings.
        num_kv_blocks: blocks of the target's paged KV cache.
        policy: chooses each request's K per step (`spec_decode.factory.build_policy`).
        kernels: native-kernel behaviours applied around each step (None: the
            process-wide settings; `worker.kernel_switches`).
    """

    def __init__(self, target: ModelRunner, proposer: Proposer, processor: OutputProcessor,
                 scheduler_config: SchedulerConfig, num_kv_blocks: int,
                 policy: SpeculationPolicy, kernels: KernelConfig | None = None) -> None:
        self.target = target
        self.proposer = proposer
        self.processor = processor
        self.policy = policy
        self.kv_cache = target.new_paged_cache(num_kv_blocks, scheduler_config.block_size,
                                               scheduler_config.kv_cache_dtype)
        self.scheduler = Scheduler(scheduler_config, num_kv_blocks, target.max_model_len)
        self.stats = EngineStats()
        kernels = kernels or KernelConfig()
        self.kernel_switches = KernelSwitches(kernels)
        # Fewer threads while other processes hold cores (specmoe/utils/threads.py).
        self.thread_governor = make_thread_governor(torch.set_num_threads,
                                                    torch.get_num_threads(),
                                                    kernels.fixed_threads)
        self._generators: dict[str, torch.Generator] = {}
        self.step_observer = NullStepObserver()
        self._failed: list[Request] = []  # this step's requests failed alone (`_fail`)

    def add_request(self, req: Request, generator: torch.Generator) -> None:
        """Queue a request; `generator` drives all of its random draws.

        Raises:
            ValueError: duplicate id, or a request that cannot fit in the KV cache.
        """
        req.num_speculative_tokens = self.policy.request_k(
            req.params.num_speculative_tokens)
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
        """Zero the counters (`stats`); its realized gain factors are the policy's state
        (`SpeculationPolicy.observe` sets them), not counters, and stay."""
        self.stats = EngineStats(realized_gain_factors=self.stats.realized_gain_factors)

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
        with self.kernel_switches:
            return self._step()

    def _step(self) -> list[Request]:
        self.thread_governor.update()
        self.policy.before_schedule(self.scheduler, self.stats)
        out = self.scheduler.schedule()
        for request_id in out.preempted_request_ids:
            self.proposer.free(request_id)
        if not out.scheduled:
            if self.has_unfinished_requests:
                raise RuntimeError("no request could be scheduled; the KV cache is too small")
            return []
        self._failed = []
        report, num_rejected = self._run(out.scheduled)
        finished = self.scheduler.update_from_output(out, num_rejected)
        self.policy.observe(report, self.stats)
        for req in finished:
            self._finish(req)
        live = report.live
        self._propose(live, self.policy.draft_lengths(live, len(self.scheduler.running),
                                                      self.stats))
        self.stats.record_step(out.stats)
        return finished + self._failed

    def _run(self, scheduled: list[ScheduledRequest]) -> tuple[StepReport, dict[str, int]]:
        """The target forward over the batch and the verification of every request that
        reached its last token: what they ran and verified, and per request id its
        rejected drafts."""
        windows = [len(s.token_ids) for s in scheduled]
        t0 = time.perf_counter()
        with self.policy.watch_forward(windows):
            logits = self._forward(scheduled)
        sampled = [s for s in scheduled if s.request_id in logits]
        reqs = [self.scheduler.requests[s.request_id] for s in sampled]
        num_rejected, num_accepted, num_emitted = self._verify(
            sampled, reqs, [logits[s.request_id] for s in sampled])
        self.step_observer.on_step_verified(scheduled, self.scheduler.requests, num_accepted)
        seconds = time.perf_counter() - t0
        verified = [req for s, req in zip(sampled, reqs) if s.num_draft_tokens]
        for req in verified:
            req.spec_stats.verify_time_s += seconds
        if verified:
            self.stats.spec.verify_time_s += seconds
        self.stats.num_generation_tokens += sum(num_emitted.values())
        return StepReport(windows, reqs, [s.num_draft_tokens for s in sampled], num_accepted,
                          seconds, bool(self._failed)), num_rejected

    def _finish(self, req: Request) -> None:
        self._forget(req.request_id)
        self.stats.spec.merge(req.spec_stats, times=False)
        req.metrics.decode_time_s = (time.perf_counter() - req.metrics.arrival_time
                                     - req.metrics.first_token_time_s)

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
        were kept, and the tokens it emitted (absent: it failed). A request whose
        verification or output processing fails is failed alone (its neighbours' draws
        are unchanged)."""
        rows = [self._verify_row(s, req, row) for s, req, row in zip(sampled, reqs, logits)]
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

    def _verify_row(self, s: ScheduledRequest, req: Request, logits: torch.Tensor) -> VerifyRow:
        req.draft.truncate(s.num_draft_tokens)  # as scheduled (a no-op: the scheduler cut it)
        return VerifyRow(logits, s.token_ids[len(s.token_ids) - s.num_draft_tokens:],
                         req.draft.probs, req.params, self._generators[s.request_id])

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

    def _propose(self, live: list[Request], ks: dict[str, int]) -> None:
        """Draft `ks[request_id]` next tokens of every request that speculates, in one
        batch; the policy says how many of each proposal to keep."""
        asks = [(req, self._ask(req, ks[req.request_id])) for req in live
                if ks.get(req.request_id, 0) > 0]
        if not asks:
            return
        t0 = time.perf_counter()
        proposals = run_isolated(self.proposer.propose,
                                 lambda ask: self.proposer.propose([ask])[0],
                                 [ask for _, ask in asks])
        seconds = time.perf_counter() - t0
        self.stats.spec.draft_time_s += seconds
        failed = [isinstance(p, Exception) for p in proposals]
        keep = self.policy.proposed(DraftReport(
            [ask.request_id for _, ask in asks], [ask.max_num_draft_tokens for _, ask in asks],
            [0 if f else len(p.token_ids) for p, f in zip(proposals, failed)],
            [0 if f else p.match_length for p, f in zip(proposals, failed)],
            failed, seconds, len(live)), self.stats)
        for (req, _), proposal, n in zip(asks, proposals, keep):
            if isinstance(proposal, Exception):
                self._fail(req, proposal)
                continue
            req.draft = DraftState(proposal.token_ids, proposal.probs, proposal.match_length)
            req.draft.truncate(n)
            req.spec_stats.draft_time_s += seconds

    def _ask(self, req: Request, k: int) -> ProposeRequest:
        """What the proposer is asked for `req`: k tokens continuing its context."""
        return ProposeRequest(req.request_id, req.all_token_ids, k, req.params,
                              self._generators[req.request_id])

    def _forget(self, request_id: str) -> None:
        self.proposer.free(request_id)
        self.policy.forget(request_id)
        self._generators.pop(request_id, None)


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
