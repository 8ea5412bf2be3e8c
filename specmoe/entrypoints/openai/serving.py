"""Completions and chat completions over the AsyncEngine: validation into engine requests,
n choices per prompt, non-streaming collection and server-sent-event streaming.

Chat templating and tokenisation (and the n clones of each request) run in a small worker
pool, never on the event loop: a multi-megabyte prompt takes seconds to tokenize, and the
loop must go on answering /health and streaming meanwhile. (The HF fast tokenizer's encode
is thread-safe and releases the GIL.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from specmoe.engine.async_engine import (AsyncEngine, EngineDrainingError, EngineFailedError,
                                         QueueFullError, RequestDelta, RequestFailedError,
                                         RequestStream)
from specmoe.entrypoints.openai import protocol as P
from specmoe.entrypoints.openai.token_bytes import TokenBytes
from specmoe.outputs import SpecDecodeStats, TokenLogprob
from specmoe.request import Request
from specmoe.sampling_params import SamplingParams

_PARAM_IN_MESSAGE = re.compile(r"invalid (\w+)")
logger = logging.getLogger("specmoe.server")

RETRY_AFTER_S = 1  # seconds a client told 429 waits before retrying
NUM_PREPROCESS_THREADS = 2  # worker threads for chat templates and tokenisation
CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request": a response nobody receives
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks for a disconnect


class APIError(Exception):
    """An error answered with an OpenAI-style body and an HTTP status.

    Args:
        status: HTTP status code (400, 401, 404, 429, 500, 503).
        message: what went wrong, naming the bad value and what would be accepted.
        param: the request field at fault, if any.
    """

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        # a lone surrogate from the request (an unknown field's name) cannot go out as UTF-8
        message, param = _printable(message), _printable(param)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        body = P.ErrorResponse(error=P.ErrorInfo(
            message=self.message, type=self.TYPES.get(self.status, "error"), param=self.param,
            code=self.code))  # a string, or null as OpenAI sends for most 400s
        # A full queue drains within seconds: tell clients when to retry (RFC 9110, 10.2.3).
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)


@dataclass
class _Choice:
    """What one choice accumulated."""

    index: int
    num_prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    spec: SpecDecodeStats | None = None

    def add(self, d: RequestDelta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs or []
        self.finish_reason = d.finish_reason or self.finish_reason
        if d.output is not None:
            self.spec = d.output.spec_stats


class OpenAIServing:
    """The generation endpoints.

    Args:
        engine: the running AsyncEngine.
        served_model_name: the name clients pass as `model`.
    """

    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.llm = engine.llm
        self.model_name = served_model_name
        self._pool = ThreadPoolExecutor(NUM_PREPROCESS_THREADS,
                                        thread_name_prefix="specmoe-preprocess")
        self._token_bytes = TokenBytes(self.llm.tokenizer)

    def close(self) -> None:
        """Stop the worker threads (the app's shutdown)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _offload(self, fn, *args):
        """fn(*args) in the worker pool; its exception (an APIError) is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- entry points ----------------------------------------------------------------

    async def completions(self, body: P.CompletionRequest, raw: HTTPRequest):
        """POST /v1/completions. Raises APIError (400/404/429/503)."""
        self._check_model(body.model)
        params = self._params(body, body.max_tokens, body.logprobs)
        reqs = await self._offload(self._requests, body.prompts(), params, "prompt")
        return await self._run(body, reqs, raw, CompletionFormat(self, body))

    async def chat_completions(self, body: P.ChatCompletionRequest, raw: HTTPRequest):
        """POST /v1/chat/completions. Raises APIError (400/404/429/503)."""
        self._check_model(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.text()} for m in body.messages]
        params = self._params(body, body.requested_max_tokens(), body.num_logprobs())
        reqs = await self._offload(self._chat_requests, messages, params)
        return await self._run(body, reqs, raw, ChatFormat(self, body))

    # ---- validation ------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "model_not_found")

    def _params(self, body: P._SamplingFields, max_tokens: int | None,
                num_logprobs: int | None) -> SamplingParams:
        try:
            params = SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                min_p=body.min_p, seed=body.seed, max_tokens=max_tokens or 1, stop=body.stop,
                stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
                logprobs=num_logprobs, num_speculative_tokens=body.num_speculative_tokens)
            # The model-dependent checks too, here: raised later by make_request, their
            # errors would name the prompt instead of the field (temperature=1e-39, ...).
            self.llm.validator.check_params(params)
            return params
        except ValueError as exc:
            raise _bad_request(exc) from exc

    def _chat_requests(self, messages: list[dict], params: SamplingParams) -> list[Request]:
        """(Worker thread.) The chat template applied, then tokenized; 400 if bad."""
        try:
            prompt = self.llm.chat_prompt(messages)
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
            raise APIError(400, f"invalid messages: {exc}", "messages") from exc
        return self._requests([prompt], params, "messages")

    def _requests(self, prompts: list[str | list[int]], params: SamplingParams,
                  field_name: str) -> list[Request]:
        """(Worker thread.) Engine requests, tokenized and checked against the context;
        APIError 400 naming `field_name` if a prompt is bad."""
        try:
            return [self.llm.make_request(prompt, params) for prompt in prompts]
        except ValueError as exc:
            raise APIError(400, str(exc), field_name) from exc

    def _fit(self, body, reqs: list[Request]) -> None:
        """Fill in or check max_tokens against the context and the KV cache (400)."""
        limit = min(self.llm.max_model_len,
                    self.llm.engine.scheduler.max_tokens_per_request)
        explicit = (body.requested_max_tokens() if isinstance(body, P.ChatCompletionRequest)
                    else body.max_tokens)
        field_name = ("max_completion_tokens" if getattr(body, "max_completion_tokens", None)
                      else "max_tokens")  # the field the client set
        for req in reqs:
            num_prompt = len(req.prompt_token_ids)
            if explicit is None:
                req.params = replace(req.params, max_tokens=max(1, limit - num_prompt))
            elif num_prompt + explicit > limit:
                raise APIError(400, f"this model's maximum context length is {limit} tokens; "
                                    f"you requested {num_prompt + explicit} tokens ({num_prompt} "
                                    f"in the prompt, {explicit} for {field_name}): lower "
                                    f"{field_name} or shorten the prompt", field_name)

    # ---- running ---------------------------------------------------------------------

    async def _run(self, body, reqs: list[Request], raw: HTTPRequest, fmt: "_Format"):
        self._fit(body, reqs)
        engine_reqs, choices = await self._offload(self._expand, reqs, body.n, body.seed)
        try:
            streams = self.engine.submit(engine_reqs, is_streaming=body.stream)
        except QueueFullError as exc:
            raise APIError(429, str(exc), None, "queue_full") from exc
        except EngineDrainingError as exc:
            raise APIError(503, str(exc), None, "shutting_down") from exc
        except EngineFailedError as exc:
            raise APIError(503, str(exc), None, "engine_failed") from exc
        if body.stream:
            return StreamingResponse(self._sse(streams, choices, fmt),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        if not await self._collect(streams, choices, raw):
            return Response(status_code=CLIENT_CLOSED_STATUS)  # never received
        return JSONResponse(fmt.response(choices).model_dump(exclude_none=True))

    def _expand(self, reqs: list[Request], n: int, seed: int | None
                ) -> tuple[list[Request], list[_Choice]]:
        """(Worker thread.) n engine requests per prompt; choice i of a seeded request uses
        seed + i."""
        out, choices = [], []
        for req in reqs:
            for j in range(n):
                params = req.params
                if seed is not None and j:
                    params = replace(params, seed=(seed + j) % 2**63)
                clone = self.llm.make_request(req.prompt_token_ids, params)
                clone.prompt = req.prompt
                out.append(clone)
                choices.append(_Choice(len(choices), len(req.prompt_token_ids)))
        return out, choices

    async def _collect(self, streams: list[RequestStream], choices: list[_Choice],
                       raw: HTTPRequest) -> bool:
        """Wait for every choice: True when all finished. False when the client disconnected
        first: every stream is aborted and the request ends quietly (one info line).

        Raises:
            APIError: 400 when the engine found a choice's input made a step fail, 500 when
                it failed otherwise.
        """
        task = asyncio.ensure_future(self._drain(streams, choices))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    await asyncio.wait({task})  # let it end; its CancelledError stays there
                    logger.info("client disconnected: %d requests aborted", len(streams))
                    return False
            task.result()
        except RequestFailedError as exc:
            raise _engine_error(exc) from exc
        finally:
            task.cancel()
            for s in streams:
                s.abort()
        return True

    async def _drain(self, streams: list[RequestStream], choices: list[_Choice]) -> None:
        async for i, delta in merge_streams(streams):
            choices[i].add(delta)

    async def _sse(self, streams: list[RequestStream], choices: list[_Choice],
                   fmt: "_Format") -> AsyncIterator[str]:
        """Server-sent events: one `data:` line per chunk, then `data: [DONE]`. An engine
        failure mid-stream is sent as an error event before [DONE]."""
        try:
            for chunk in fmt.first_chunks(choices):
                yield _event(fmt.with_usage(chunk, choices))
            async for i, delta in merge_streams(streams):
                choices[i].add(delta)
                chunk = fmt.chunk(choices[i], delta)
                if chunk is not None:
                    yield _event(fmt.with_usage(chunk, choices))
            usage = fmt.usage_chunk(choices)
            if usage is not None:
                yield _event(usage)
        except RequestFailedError as exc:
            yield _event(_engine_error(exc).response().body)
        yield "data: [DONE]\n\n"

    # ---- shared formatting helpers ---------------------------------------------------

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per app
    def token_text(self, token_id: int) -> str:
        """The text of one token (as the tokenizer decodes it alone)."""
        tok = self.llm.tokenizer
        return tok.decode([token_id]) if tok is not None else str(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token: a part of a UTF-8 character stays those bytes (its text
        alone decodes to U+FFFD)."""
        return self._token_bytes(token_id, self.token_text(token_id))


async def merge_streams(streams: list[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(choice index, delta) from several request streams as they arrive. Raises the first
    RequestFailedError; on exit (finished, failed or cancelled) aborts every stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for d in s:
                queue.put_nowait((i, d))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def spec_info(choices: list[_Choice]) -> P.SpecDecodeInfo:
    """The speculation statistics of all choices, summed."""
    total = SpecDecodeStats()
    for c in choices:
        if c.spec is not None:
            total.merge(c.spec)
    return P.SpecDecodeInfo(
        num_drafts=total.num_drafts, num_draft_tokens=total.num_draft_tokens,
        num_accepted_tokens=total.num_accepted_tokens, acceptance_rate=total.acceptance_rate,
        mean_acceptance_length=total.mean_acceptance_length,
        acceptance_per_position=total.acceptance_per_position())


def usage_info(choices: list[_Choice], n: int) -> P.UsageInfo:
    """Prompt tokens counted once per prompt (n choices share one); completion tokens of all
    choices."""
    prompt = sum(c.num_prompt_tokens for c in choices[::n])
    completion = sum(len(c.token_ids) for c in choices)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion)


class _Format:
    """Builds the response objects of one endpoint."""

    def __init__(self, serving: OpenAIServing, body) -> None:
        self.serving, self.body = serving, body
        self.id = P.random_id(self.PREFIX)
        self.model = serving.model_name

    def first_chunks(self, choices: list[_Choice]) -> list[BaseModel]:
        return []

    def with_usage(self, chunk: BaseModel, choices: list[_Choice]) -> BaseModel:
        """`chunk`, carrying the usage so far (every choice's tokens up to now) when the
        request asked for `stream_options.continuous_usage_stats`."""
        opts = self.body.stream_options
        if opts is not None and opts.continuous_usage_stats:
            chunk.usage = usage_info(choices, self.body.n)
        return chunk

    def usage_chunk(self, choices: list[_Choice]) -> BaseModel | None:
        opts = self.body.stream_options
        if opts is None or not opts.include_usage:
            return None
        return self.CHUNK(id=self.id, model=self.model, choices=[],
                          usage=usage_info(choices, self.body.n), spec_decode=spec_info(choices))


class CompletionFormat(_Format):
    """/v1/completions responses and chunks."""

    PREFIX = "cmpl"
    CHUNK = P.CompletionResponse

    def __init__(self, serving: OpenAIServing, body: P.CompletionRequest) -> None:
        super().__init__(serving, body)
        self._offsets: dict[int, int] = {}

    def logprobs(self, index: int, entries: list[TokenLogprob]) -> P.CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        text = self.serving.token_text
        out = P.CompletionLogprobs()
        for e in entries:
            token = text(e.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append({text(t): lp for t, lp in e.top_logprobs})
            offset = self._offsets.get(index, 0)
            out.text_offset.append(offset)
            self._offsets[index] = offset + len(token)
        return out

    def response(self, choices: list[_Choice]) -> P.CompletionResponse:
        return P.CompletionResponse(
            id=self.id, model=self.model, usage=usage_info(choices, self.body.n),
            spec_decode=spec_info(choices),
            choices=[P.CompletionChoice(index=c.index, text=c.text,
                                        logprobs=self.logprobs(c.index, c.logprobs),
                                        finish_reason=c.finish_reason) for c in choices])

    def chunk(self, c: _Choice, d: RequestDelta) -> BaseModel | None:
        if not d.text and d.finish_reason is None and self.body.logprobs is None:
            return None
        return P.CompletionResponse(id=self.id, model=self.model, choices=[P.CompletionChoice(
            index=c.index, text=d.text, logprobs=self.logprobs(c.index, d.logprobs or []),
            finish_reason=d.finish_reason)])


class ChatFormat(_Format):
    """/v1/chat/completions responses and chunks."""

    PREFIX = "chatcmpl"
    CHUNK = P.ChatCompletionChunk

    def logprobs(self, entries: list[TokenLogprob]) -> P.ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        serving = self.serving

        def top(t: int, lp: float) -> P.TopLogprob:
            return P.TopLogprob(token=serving.token_text(t), logprob=lp,
                                bytes=list(serving.token_bytes(t)))
        return P.ChatLogprobs(content=[P.ChatTokenLogprob(
            **top(e.token_id, e.logprob).model_dump(),
            top_logprobs=[top(t, lp) for t, lp in e.top_logprobs]) for e in entries])

    def response(self, choices: list[_Choice]) -> P.ChatCompletionResponse:
        return P.ChatCompletionResponse(
            id=self.id, model=self.model, usage=usage_info(choices, self.body.n),
            spec_decode=spec_info(choices),
            choices=[P.ChatChoice(index=c.index, message=P.ChatResponseMessage(content=c.text),
                                  logprobs=self.logprobs(c.logprobs),
                                  finish_reason=c.finish_reason) for c in choices])

    def first_chunks(self, choices: list[_Choice]) -> list[BaseModel]:
        return [P.ChatCompletionChunk(id=self.id, model=self.model, choices=[
            P.ChatStreamChoice(index=c.index, delta=P.DeltaMessage(role="assistant", content=""))
        ]) for c in choices]

    def chunk(self, c: _Choice, d: RequestDelta) -> BaseModel | None:
        if not d.text and d.finish_reason is None and not self.body.logprobs:
            return None
        return P.ChatCompletionChunk(id=self.id, model=self.model, choices=[P.ChatStreamChoice(
            index=c.index, delta=P.DeltaMessage(content=d.text or None),
            logprobs=self.logprobs(d.logprobs or []), finish_reason=d.finish_reason)])


def _event(chunk: BaseModel | bytes) -> str:
    data = chunk.decode() if isinstance(chunk, bytes) else chunk.model_dump_json(
        exclude_none=True)
    return f"data: {data}\n\n"


def _bad_request(exc: ValueError) -> APIError:
    match = _PARAM_IN_MESSAGE.match(str(exc))
    return APIError(400, str(exc), match.group(1) if match else None)


def _engine_error(exc: RequestFailedError) -> APIError:
    """400 when the engine isolated this request as the cause of a failed step, else 500."""
    code = "invalid_request" if exc.status < 500 else "engine_error"
    return APIError(exc.status, str(exc), None, code)


def _printable(text: str | None) -> str | None:
    """`text` with any lone surrogate escaped ("\\ud800"), so it encodes as UTF-8."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
