"""An asyncio front end over the batched engine: one background thread drives `LLM.step()`.

The HTTP server (entrypoints/openai) talks to the engine only through `AsyncEngine`:

- `submit` (event-loop thread) admits already-validated `Request`s into a thread-safe inbox,
  or raises `QueueFullError` (the bounded waiting queue is full) / `EngineDrainingError`
  (shutting down). Each request gets a `RequestStream`, an async iterator of `RequestDelta`s.
- The engine thread owns the engine: it moves the inbox into it, applies aborts, runs one
  step at a time and, after each, pushes to every streaming request the tokens, logprobs and
  text it emitted since the last push (text only up to a safe point: never inside a multi-byte
  UTF-8 character, never into what may become a stop string). Deltas cross threads with
  `loop.call_soon_threadsafe`; the engine is never touched from the event loop.
- Failure isolation: a step that raises fails the requests that were in the engine at that
  moment (each gets a `RequestFailedError` and is aborted, freeing its KV cache blocks); the
  loop goes on serving new requests. A request whose own bookkeeping raises fails alone.
- `shutdown` stops admissions, waits for in-flight requests up to a timeout, aborts the rest
  and joins the thread.

An `EngineObserver` (metrics) sees a snapshot after every step and every finished request;
the default observer does nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from specmoe.engine.detokenizer import IncrementalDetokenizer, safe_stream_text
from specmoe.outputs import RequestOutput, SpecDecodeStats, TokenLogprob
from specmoe.request import Request

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting` requests already (HTTP 429)."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and accepts no new requests (HTTP 503)."""


class EngineFailedError(RuntimeError):
    """The engine can serve no request again (its expert-parallel group failed)."""


class RequestFailedError(RuntimeError):
    """The engine failed while processing this request; others go on.

    Attributes:
        status: the HTTP status it maps to: 400 when the engine found that this request's
            own input made a step fail (`EngineCore.step` isolated it), else 500.
    """

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class RequestDelta:
    """What one request emitted since its previous delta.

    Attributes:
        request_id: the engine request id.
        text: new text (a streaming request's text is held back at an incomplete UTF-8
            character or a possible stop-string prefix until it is safe).
        token_ids: new token ids.
        logprobs: one entry per new token when the request asked for logprobs, else None.
        finish_reason: None until the last delta, then "stop", "length" or "abort" (an
            aborted request's last delta carries what it generated and had not yet sent).
        output: the finished RequestOutput on the last delta.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    output: RequestOutput | None = None


@dataclass(slots=True)
class EngineSnapshot:
    """Engine counters after a step (or after the inbox was applied), read in the engine
    thread and handed to the observer.

    Attributes:
        num_running, num_waiting: requests holding KV cache / queued (inbox included).
        num_kv_blocks_used, num_kv_blocks_total: target KV cache blocks.
        num_prefix_queries, num_prefix_hits: prefix-cache lookups, in tokens, since start.
        num_preemptions: requests preempted since start.
        num_generation_tokens: output tokens emitted since start, as steps emit them.
        spec: speculation statistics of every finished request, merged.
        num_step_failures: steps that raised since start.
        num_spec_paused_steps: steps after which speculation paused for the batch size
            (`disable_by_batch_size`) since start.
        num_steps: engine steps that ran a forward since start.
        draft_k_histogram: K -> (request, step) pairs allowed K drafts since start.
        num_step_time_predictions: steps whose time the adaptive policy predicted.
        recent_step_time_errors: the relative errors of the latest predictions (at most
            `stats.STEP_ERRORS_KEPT`), newest last.
        realized_gain_factors: `EngineStats.realized_gain_factors`.
        num_trimmed_draft_tokens: `EngineStats.num_trimmed_draft_tokens`.
        num_shadow_draft_tokens, num_shadow_accepted_tokens: the same `EngineStats` counts.
    """

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_prefix_queries: int
    num_prefix_hits: int
    num_preemptions: int
    spec: SpecDecodeStats
    num_step_failures: int
    num_spec_paused_steps: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    draft_k_histogram: dict[int, int] = field(default_factory=dict)
    num_step_time_predictions: int = 0
    recent_step_time_errors: tuple[float, ...] = ()
    realized_gain_factors: dict[int, float] = field(default_factory=dict)
    num_trimmed_draft_tokens: int = 0
    num_shadow_draft_tokens: int = 0
    num_shadow_accepted_tokens: int = 0


@dataclass(slots=True)
class FinishedRecord:
    """Timings of one finished (or aborted) request, in seconds since its submission.

    Attributes:
        num_prompt_tokens, num_output_tokens: token counts.
        finish_reason: "stop", "length", "abort" or "error".
        ttft_s: to its first token (None when it emitted none).
        e2e_s: to its finish.
        acceptance_rate: its draft tokens accepted / proposed (None when it drafted none).
    """

    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str
    ttft_s: float | None
    e2e_s: float
    acceptance_rate: float | None = None


class NullEngineObserver:
    """Observes nothing (the default)."""

    def on_step(self, snapshot: EngineSnapshot) -> None:
        """Called in the engine thread after each step and after inbox changes."""

    def on_finished(self, record: FinishedRecord) -> None:
        """Called in the engine thread once per finished, aborted or failed request."""


class RequestStream:
    """The deltas of one request, consumed on the event loop: `async for delta in stream`.

    Iteration ends after the delta with a finish_reason; raises RequestFailedError when the
    engine failed the request. `abort()` (idempotent) asks the engine to drop it.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestDelta | Exception] = asyncio.Queue()
        self.is_finished = False

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestDelta]:
        while not self.is_finished:
            item = await self.queue.get()
            if isinstance(item, Exception):
                self.is_finished = True
                raise item
            self.is_finished = item.finish_reason is not None
            yield item

    def abort(self) -> None:
        if not self.is_finished:
            self.is_finished = True
            self._engine.abort(self.request_id)


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one submitted request."""

    req: Request
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    is_streaming: bool
    submit_time: float
    num_sent_tokens: int = 0
    sent_text: str = ""
    first_token_time: float | None = None
    detokenizer: IncrementalDetokenizer | None = None  # streaming text, built at first use


@dataclass
class _Inbox:
    """Requests and aborts handed from the event loop to the engine thread (under `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    new: list[_Tracked] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    is_abort_all: bool = False  # abort every request the engine holds
    num_waiting: int = 0  # inbox + the scheduler's waiting queue, updated atomically
    num_free_seqs: int = 0  # running slots free at the last publish (max_num_seqs - running)
    num_in_flight: int = 0  # submitted, final delta or error not yet delivered


class AsyncEngine:
    """Drives an `LLM` from one background thread for asyncio callers.

    Args:
        llm: the engine (specmoe.engine.llm_engine.LLM); only this object's thread uses it.
        max_waiting: requests that may wait beyond the free running slots (max_num_seqs
            minus running) before `submit` raises QueueFullError; must be >= 1.
        observer: receives snapshots and finished-request records (metrics).

    Raises:
        ValueError: max_waiting < 1.
    """

    def __init__(self, llm, max_waiting: int = 256,
                 observer: NullEngineObserver | None = None) -> None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"invalid max_waiting={max_waiting!r}: must be an int >= 1")
        self.llm = llm
        self.max_waiting = max_waiting
        self.observer = observer or NullEngineObserver()
        self._inbox = _Inbox(num_free_seqs=llm.engine.scheduler.config.max_num_seqs)
        self._tracked: dict[str, _Tracked] = {}
        self._wakeup = threading.Event()
        self._stopping = False
        self._is_draining = False
        self._num_step_failures = 0
        self._thread = threading.Thread(target=self._run, name="specmoe-engine", daemon=True)

    # ---- event-loop side -------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (once)."""
        self._thread.start()

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    def stop_accepting(self) -> None:
        """From now on `submit` raises EngineDrainingError; in-flight requests go on."""
        self._is_draining = True

    @property
    def num_in_flight(self) -> int:
        """Requests submitted whose final delta (or error) is not yet delivered."""
        return self._inbox.num_in_flight

    def submit(self, requests: list[Request], is_streaming: bool) -> list[RequestStream]:
        """Admit requests built by `LLM.make_request` (all or none); call on the event loop.

        Args:
            is_streaming: push partial deltas after every step (else only the final one).
        Raises:
            EngineDrainingError: shutdown has begun.
            EngineFailedError: the target failed for good (`ModelRunner.failure`).
            QueueFullError: the requests would make more than max_waiting wait beyond the
                free running slots. Each engine request counts (an HTTP request with p
                prompts and n choices is p x n); a batch larger than max_waiting is still
                admitted when nothing waits, so it is never refused forever (the server
                caps one call at MAX_ENGINE_REQUESTS_PER_CALL).
        """
        if self._is_draining or not self._thread.is_alive():
            raise EngineDrainingError("the server is shutting down")
        if self.llm.target.failure is not None:
            raise EngineFailedError(f"the engine cannot serve: {self.llm.target.failure}")
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        streams = [RequestStream(self, r.request_id) for r in requests]
        with self._inbox.lock:
            excess = self._inbox.num_waiting - self._inbox.num_free_seqs
            if excess > 0 and excess + len(requests) > self.max_waiting:
                raise QueueFullError(
                    f"the waiting queue is full ({excess} requests wait, {len(requests)} "
                    f"more would pass --max-waiting {self.max_waiting}); retry later")
            self._inbox.new.extend(_Tracked(r, s, loop, is_streaming, now)
                                   for r, s in zip(requests, streams))
            self._inbox.num_waiting += len(requests)
            self._inbox.num_in_flight += len(requests)
        self._wakeup.set()
        return streams

    def abort(self, request_id: str) -> None:
        """Ask the engine thread to drop a request (a no-op once it finished)."""
        with self._inbox.lock:
            self._inbox.aborts.append(request_id)
        self._wakeup.set()

    def abort_all(self) -> None:
        """Ask the engine thread to abort every request it holds (their streams end with
        finish_reason "abort"); requests submitted later are not affected."""
        with self._inbox.lock:
            self._inbox.is_abort_all = True
        self._wakeup.set()

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop admissions, wait up to `timeout_s` seconds for in-flight requests, abort the
        rest (their streams end with finish_reason "abort") and join the engine thread."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stopping = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join, 30.0)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False when `timeout_s` seconds passed first."""
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    # ---- engine-thread side ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._apply_inbox()
            if self._stopping:
                self._abort_all()
                return
            if not self.llm.engine.has_unfinished_requests:
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            self._step_once()

    def _apply_inbox(self) -> None:
        with self._inbox.lock:
            new, self._inbox.new = self._inbox.new, []
            aborts, self._inbox.aborts = self._inbox.aborts, []
            is_abort_all, self._inbox.is_abort_all = self._inbox.is_abort_all, False
        for t in new:
            self._add(t)
        if is_abort_all:
            aborts = list(self._tracked)
        for request_id in aborts:
            self._abort(request_id, "abort")
        self._publish()

    def _add(self, t: _Tracked) -> None:
        try:
            self.llm.add_request(t.req)
        except Exception as exc:  # noqa: BLE001 - isolate one bad request
            self._deliver(t, exc)
            self._record(t, "error")
            return
        self._tracked[t.req.request_id] = t

    def _abort(self, request_id: str, reason: str, error: Exception | None = None) -> None:
        t = self._tracked.pop(request_id, None)
        try:
            self.llm.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - the request is gone either way
            logger.exception("aborting request %s failed", request_id)
        if t is None:
            return
        self._deliver(t, error or self._abort_delta(t))
        self._record(t, reason)

    def _abort_delta(self, t: _Tracked) -> RequestDelta:
        """The last delta of an aborted request: what it generated and has not yet sent
        (a non-streaming client gets its whole partial output), finish_reason "abort"."""
        req = t.req
        delta = RequestDelta(req.request_id, "", req.output_token_ids[t.num_sent_tokens:],
                             None, "abort")
        if req.params.logprobs is not None:
            delta.logprobs = req.output_logprobs[t.num_sent_tokens:]
        try:
            text = self.llm.processor.decode(req.output_token_ids)
        except Exception:  # noqa: BLE001 - the tokens still go out
            logger.exception("decoding aborted request %s", req.request_id)
            return delta
        if text.startswith(t.sent_text):
            delta.text = text[len(t.sent_text):]
        return delta

    def _abort_all(self) -> None:
        for request_id in list(self._tracked):
            self._abort(request_id, "abort")
        self._publish()

    def _step_once(self) -> None:
        try:
            finished = self.llm.step()
        except Exception as exc:  # noqa: BLE001 - fail the step's requests, keep serving
            logger.exception("engine step failed; failing %d requests", len(self._tracked))
            self._num_step_failures += 1
            error = RequestFailedError(f"engine step failed: {type(exc).__name__}: {exc}")
            for request_id in list(self._tracked):
                self._abort(request_id, "error", error)
            self._publish()
            return
        now = time.perf_counter()
        for out in finished:
            self._finish(out, now)
        for t in list(self._tracked.values()):
            self._push_partial(t, now)
        self._publish()

    def _finish(self, out: RequestOutput, now: float) -> None:
        t = self._tracked.pop(out.request_id, None)
        if t is None:
            return
        if out.finish_reason == "error":  # the engine found this request's input at fault
            self._deliver(t, RequestFailedError(f"request failed: {out.error}", status=400))
            self._record(t, "error")
            return
        try:
            new_ids = out.token_ids[t.num_sent_tokens:]
            logprobs = out.logprobs[t.num_sent_tokens:] if out.logprobs is not None else None
            text = out.text[len(t.sent_text):] if out.text.startswith(t.sent_text) else ""
            if t.first_token_time is None and out.token_ids:
                t.first_token_time = now
            self._deliver(t, RequestDelta(out.request_id, text, new_ids, logprobs,
                                          out.finish_reason, out))
            self._record(t, out.finish_reason)
        except Exception as exc:  # noqa: BLE001
            self._deliver(t, RequestFailedError(f"output processing failed: {exc}"))
            self._record(t, "error")

    def _push_partial(self, t: _Tracked, now: float) -> None:
        req = t.req
        num_tokens = len(req.output_token_ids)
        if num_tokens and t.first_token_time is None:
            t.first_token_time = now
        if not t.is_streaming or num_tokens == t.num_sent_tokens:
            return
        try:
            delta = self._partial_delta(t, num_tokens)
        except Exception as exc:  # noqa: BLE001 - fail this request alone
            self._abort(req.request_id, "error", RequestFailedError(
                f"output processing failed: {type(exc).__name__}: {exc}"))
            return
        self._deliver(t, delta)

    def _partial_delta(self, t: _Tracked, num_tokens: int) -> RequestDelta:
        req = t.req
        new_ids = req.output_token_ids[t.num_sent_tokens:num_tokens]
        logprobs = (req.output_logprobs[t.num_sent_tokens:num_tokens]
                    if req.params.logprobs is not None else None)
        t.num_sent_tokens = num_tokens
        if t.detokenizer is None:
            t.detokenizer = IncrementalDetokenizer(self.llm.processor.decode)
        text = safe_stream_text(t.detokenizer.update(req.output_token_ids), req.params.stop)
        delta_text = ""
        if text.startswith(t.sent_text) and len(text) > len(t.sent_text):
            delta_text = text[len(t.sent_text):]
            t.sent_text = text
        return RequestDelta(req.request_id, delta_text, new_ids, logprobs)

    def _deliver(self, t: _Tracked, item: RequestDelta | Exception) -> None:
        if isinstance(item, Exception) or item.finish_reason is not None:
            with self._inbox.lock:
                self._inbox.num_in_flight -= 1
        try:
            t.loop.call_soon_threadsafe(t.stream.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _record(self, t: _Tracked, reason: str) -> None:
        now = time.perf_counter()
        ttft = None if t.first_token_time is None else t.first_token_time - t.submit_time
        self._safe_observe(self.observer.on_finished, FinishedRecord(
            len(t.req.prompt_token_ids), len(t.req.output_token_ids), reason, ttft,
            now - t.submit_time, t.req.spec_stats.acceptance_rate
            if t.req.spec_stats.num_draft_tokens else None))

    def _publish(self) -> None:
        engine = self.llm.engine
        sched = engine.scheduler
        pool = sched.kv_cache.block_pool
        with self._inbox.lock:
            self._inbox.num_waiting = len(sched.waiting) + len(self._inbox.new)
            self._inbox.num_free_seqs = max(0, sched.config.max_num_seqs - len(sched.running))
            num_waiting = self._inbox.num_waiting
        self._safe_observe(self.observer.on_step, EngineSnapshot(
            num_running=len(sched.running), num_waiting=num_waiting,
            num_kv_blocks_used=pool.num_used_blocks, num_kv_blocks_total=pool.num_blocks,
            num_prefix_queries=pool.prefix_cache_stats.num_query_tokens,
            num_prefix_hits=pool.prefix_cache_stats.num_hit_tokens,
            num_preemptions=engine.stats.num_preemptions, spec=engine.stats.spec,
            num_step_failures=self._num_step_failures,
            num_spec_paused_steps=engine.stats.num_spec_paused_steps,
            num_generation_tokens=engine.stats.num_generation_tokens,
            num_steps=engine.stats.num_steps,
            draft_k_histogram=dict(engine.stats.draft_k_histogram),
            num_step_time_predictions=engine.stats.num_step_time_predictions,
            recent_step_time_errors=_newest(engine.stats.step_time_errors, 8),
            realized_gain_factors=dict(engine.stats.realized_gain_factors),
            num_trimmed_draft_tokens=engine.stats.num_trimmed_draft_tokens,
            num_shadow_draft_tokens=engine.stats.num_shadow_draft_tokens,
            num_shadow_accepted_tokens=engine.stats.num_shadow_accepted_tokens))

    @staticmethod
    def _safe_observe(fn, arg) -> None:
        try:
            fn(arg)
        except Exception:  # noqa: BLE001 - metrics never take the engine down
            logger.exception("engine observer failed")


def _newest(values, n: int) -> tuple:
    """The last `n` items of a deque, oldest first, without copying the rest."""
    return tuple(reversed(tuple(itertools.islice(reversed(values), n))))
