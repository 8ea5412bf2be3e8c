"""Continuous batching with chunked prefill, speculative lookahead and preemption (L2, no torch).

Modelled on vLLM v1's scheduler (our own code). There are no prefill and decode phases: each
step, every request is scheduled the gap between its computed tokens and its verified tokens
(a prompt chunk, or its last token), plus its draft tokens when the gap fits in the budget.
Requests join and leave at every step.

One step (`schedule`):
1. Running requests, oldest first, each within the step's token budget: a long prompt is cut
   into chunks (chunked prefill); drafts are cut to what is left of the budget. KV cache slots
   are allocated for the gap plus the drafts (lookahead slots). When blocks run out, the
   request's own drafts are dropped first; if that is not enough, the newest running request is
   preempted by recomputation: its computed full blocks are offered to the prefix cache, all its
   blocks are freed, its drafts dropped, and it goes back to the head of the waiting queue with
   num_computed_tokens = 0 (prefix-cache hits can bring its blocks back on resumption).
2. If nothing was preempted, waiting requests are admitted oldest first while the budget, the
   cap on running requests and the free blocks allow, starting from their prefix-cache hits.

After the forward (`update_from_output`): each request's num_computed_tokens advances by the
tokens it computed minus its rejected drafts, and the blocks past it are given back; finished
requests free everything.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specmoe.config import SchedulerConfig
from specmoe.engine.kv_cache_manager import KVCacheManager
from specmoe.engine.stats import StepStats
from specmoe.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    """The work of one request in one step.

    Attributes:
        request_id: the request.
        token_ids: tokens to compute: verified tokens from position start_pos, then drafts.
        start_pos: its num_computed_tokens when scheduled.
        block_ids: its whole block table.
        num_draft_tokens: drafts at the end of token_ids.
        num_logits: logits needed: num_draft_tokens + 1 when token_ids reach the end of its
            verified tokens (it samples), else 0 (a prompt chunk with more to come).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    num_draft_tokens: int
    num_logits: int


@dataclass(slots=True)
class SchedulerOutput:
    """One step's schedule.

    Attributes:
        scheduled: the requests computed this step, in batch order.
        preempted_request_ids: requests whose KV cache was freed this step.
        stats: counters of this step.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    stats: StepStats | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


class Scheduler:
    """Decides which tokens of which requests each step computes.

    Args:
        config: budget, caps and KV cache block settings.
        num_blocks: KV cache blocks of the target model.
        max_model_len: context limit; a request never holds more tokens (None: no limit).

    Raises:
        ValueError: from `SchedulerConfig` / `KVCacheManager` for invalid sizes.
    """

    def __init__(self, config: SchedulerConfig, num_blocks: int,
                 max_model_len: int | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv_cache = KVCacheManager(num_blocks, config.block_size,
                                       config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    @property
    def max_tokens_per_request(self) -> int:
        """The most tokens (prompt + output + drafts) one request can hold: the pool size."""
        return self.kv_cache.num_blocks * self.kv_cache.block_size

    def add_request(self, req: Request) -> None:
        """Queue a request (status WAITING).

        Raises:
            ValueError: its id is already queued, or its prompt plus max_tokens (capped at
                max_model_len) cannot fit in the whole KV cache (it could never finish).
        """
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request_id={req.request_id!r}")
        needed = req.num_tokens + req.params.max_tokens
        if self.max_model_len is not None:
            needed = min(needed, self.max_model_len)
        if needed > self.max_tokens_per_request:
            raise ValueError(
                f"request {req.request_id!r} needs up to {needed} tokens of KV cache "
                f"(prompt {req.num_tokens} + max_tokens {req.params.max_tokens}) but the cache "
                f"holds {self.max_tokens_per_request}: lower max_tokens or enlarge the cache")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def abort_request(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its blocks; None if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req)
        return req

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        """Schedule one step (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_request_ids:
            self._schedule_waiting(out, budget)
        out.stats = self._step_stats(out)
        return out

    def prompt_rows_ahead(self, decode_rows: int) -> int:
        """Rows of prompt chunks the next step is expected to compute beside `decode_rows`
        rows of decoding requests: the rest of the running requests' prompts (chunked
        prefill), then the prompts of the waiting requests it would admit, within the token
        budget and the cap on running requests. An upper bound (prefix-cache hits and the
        KV cache's room are not counted), for a speculation policy: a draft row beside a
        prompt chunk costs a compute-bound row."""
        budget = self.config.max_num_batched_tokens - decode_rows
        rows = 0
        for req in self.running:
            gap = req.num_tokens - req.num_computed_tokens
            if gap > 1:
                rows += min(gap, max(budget - rows, 0))
        seats = self.config.max_num_seqs - len(self.running)
        for req in self.waiting:
            if rows >= budget or seats <= 0:
                break
            rows += min(req.num_tokens - req.num_computed_tokens, budget - rows)
            seats -= 1
        return max(min(rows, budget), 0)

    def update_from_output(self, out: SchedulerOutput, num_rejected: dict[str, int]) -> list[Request]:
        """Advance computed-token counts after the step's forward and sampling.

        Args:
            out: the schedule of the step just run.
            num_rejected: per request id, its rejected drafts (absent: 0).

        Returns:
            the requests that finished (their `finish_reason` set by the caller); their blocks
            are freed and they leave the scheduler.
        """
        finished = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None:  # aborted after scheduling
                continue
            req.draft.clear()
            # A finished request may have kept fewer tokens than it computed (an early stop).
            req.num_computed_tokens = min(
                s.start_pos + len(s.token_ids) - num_rejected.get(s.request_id, 0),
                req.num_tokens - 1)
            if req.is_finished:
                self._finish(req)
                finished.append(req)
            elif num_rejected.get(s.request_id, 0):
                self.kv_cache.free_excess(s.request_id, req.num_computed_tokens)
        return finished

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            token_ids = req.all_token_ids
            gap = token_ids[req.num_computed_tokens:]
            chunk = gap[:budget]
            req.draft.truncate(budget - len(chunk) if len(chunk) == len(gap) else 0)
            drafts = list(req.draft.token_ids)
            block_ids = self._allocate_or_preempt(req, token_ids, chunk, drafts, out)
            if block_ids is None:  # req itself was preempted
                break
            out.scheduled.append(self._scheduled(req, chunk, drafts, block_ids))
            budget -= len(chunk) + len(drafts)
            index += 1
        return budget

    def _allocate_or_preempt(self, req: Request, token_ids: list[int], chunk: list[int],
                             drafts: list[int], out: SchedulerOutput) -> list[int] | None:
        """Allocate slots for chunk + drafts, preempting the newest requests as needed;
        returns req's block table, or None if req itself had to be preempted. Trims drafts
        in place when they are dropped."""
        while True:
            new_blocks = self.kv_cache.allocate_slots(
                req.request_id, token_ids, len(chunk), len(drafts),
                num_computed_tokens=req.num_computed_tokens)
            if new_blocks is not None:
                return self.kv_cache.get_block_ids(req.request_id)
            if drafts:  # drafts are cheaper to lose than another request's KV cache
                drafts.clear()
                req.draft.clear()
                continue
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is req:
                return None

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while (self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            token_ids = req.all_token_ids
            hits, num_hit = self.kv_cache.get_computed_blocks(req.request_id, token_ids,
                                                              record_stats=False)
            chunk = token_ids[num_hit:num_hit + budget]
            new_blocks = self.kv_cache.allocate_slots(
                req.request_id, token_ids, len(chunk), 0, hits, num_computed_tokens=num_hit)
            if new_blocks is None:
                break
            self.kv_cache.record_prefix_query(len(token_ids), num_hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self.running.append(req)
            block_ids = self.kv_cache.get_block_ids(req.request_id)
            out.scheduled.append(self._scheduled(req, chunk, [], block_ids))
            budget -= len(chunk)

    @staticmethod
    def _scheduled(req: Request, chunk: list[int], drafts: list[int],
                   block_ids: list[int]) -> ScheduledRequest:
        reaches_end = req.num_computed_tokens + len(chunk) == req.num_tokens
        return ScheduledRequest(req.request_id, chunk + drafts, req.num_computed_tokens,
                                block_ids, len(drafts), len(drafts) + 1 if reaches_end else 0)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free_blocks(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.draft.clear()
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if self.kv_cache.has_request(req.request_id):
            self._free_blocks(req)
        req.status = RequestStatus.FINISHED
        del self.requests[req.request_id]

    def _free_blocks(self, req: Request) -> None:
        """Offer its computed full blocks to the prefix cache, then free all its blocks."""
        self.kv_cache.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
        self.kv_cache.free(req.request_id)

    def _step_stats(self, out: SchedulerOutput) -> StepStats:
        return StepStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_scheduled_requests=len(out.scheduled),
            num_scheduled_tokens=out.num_scheduled_tokens,
            num_draft_tokens=sum(s.num_draft_tokens for s in out.scheduled),
            num_kv_blocks_used=self.kv_cache.block_pool.num_used_blocks,
            num_kv_blocks_free=self.kv_cache.num_free_blocks,
            num_preempted=len(out.preempted_request_ids),
            num_logits=sum(s.num_logits for s in out.scheduled))
