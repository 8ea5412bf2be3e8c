"""The OpenAI-compatible HTTP server: FastAPI app factory and uvicorn runner.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as server-sent events
ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus).

- An optional API key (`api_key`, or $SPECMOE_API_KEY in `specmoe serve`) is required as
  `Authorization: Bearer <key>` on every route except /health (401 otherwise).
- Every error is answered with OpenAI's body {"error": {"message", "type", "param", "code"}}:
  400 for a bad field (named in `param`) or a prompt too long for the context, 404 for an
  unknown model or route, 413 for a body over `max_request_bytes`, 429 when the waiting
  queue is full, 500 for an unexpected failure, 503 while shutting down. Every /v1 response,
  500 included, is counted once in `specmoe:http_responses_total{status}`.
- Graceful shutdown: the first SIGTERM or SIGINT stops admissions (503; /health answers 503
  so a load balancer drains the instance), lets in-flight requests finish for up to
  `drain_timeout_s` seconds, aborts the rest (their responses end with finish_reason
  "abort"), then exits with status 0; a second signal exits at once with status 1.
- Under expert parallelism a rank that dies or hangs fails the requests in flight within the
  group's timeout, and every later one at once; /health then answers 503 ("failed").
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import reprlib
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specmoe.engine.async_engine import AsyncEngine
from specmoe.entrypoints.openai import protocol as P
from specmoe.entrypoints.openai.metrics import ServerMetrics
from specmoe.entrypoints.openai.serving import APIError, OpenAIServing
from specmoe.utils.gc_heap import frozen_heap

logger = logging.getLogger("specmoe.server")
API_KEY_ENV = "SPECMOE_API_KEY"
ABORT_GRACE_S = 3.0  # seconds aborted requests get to end their responses after the drain
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # request body limit (HTTP 413 above it)
# Body-level validation errors: the body is not a JSON object at all (or is missing).
_BODY_TYPE_ERRORS = {"model_attributes_type", "model_type", "dict_type", "missing"}

# What the routes answer, declared in the OpenAPI schema (/openapi.json) so that clients and
# schema-driven fuzzers (tests/entrypoints/test_fuzz_schema.py) can check responses against
# it. Every error has OpenAI's body; declaring the 4XX range also drops FastAPI's default 422,
# which this server never sends (a validation error is a 400).
_ERROR = {"model": P.ErrorResponse}
_GENERATION_RESPONSES = {
    "4XX": {**_ERROR, "description": "400: a field is invalid (named in error.param) or the "
                                     "prompt is too long; 401: bad API key; 404: unknown "
                                     "model; 413: body too large; 429: waiting queue full "
                                     "(Retry-After)"},
    "5XX": {**_ERROR, "description": "500: internal error; 503: shutting down"},
}
_GET_RESPONSES = {401: {**_ERROR, "description": "bad API key"}}
# One server-sent event (`itemSchema`, as FastAPI documents its own event streams).
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "one chunk as JSON; the last event is [DONE]"}}}


def _success(model, description: str) -> dict:
    """The 200 of a generation route: `model` as JSON, or server-sent events (stream=true)."""
    return {200: {"model": model, "description": description, "content": {
        "text/event-stream": {"itemSchema": _SSE_EVENT}}}}


@dataclass
class ServerState:
    """What the routes and the middleware share.

    Attributes:
        api_key: required bearer token (None: open).
        is_draining: shutdown has begun; generation routes answer 503.
        num_in_flight: generation requests (HTTP) being served, streaming included.
        max_request_bytes: largest request body accepted (413 above it).
    """

    engine: AsyncEngine
    serving: OpenAIServing
    metrics: ServerMetrics
    api_key: str | None = None
    drain_timeout_s: float = 30.0
    is_draining: bool = False
    num_in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


def build_app(llm, served_model_name: str, api_key: str | None = None,
              max_waiting: int = 256, drain_timeout_s: float = 30.0,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """A FastAPI app serving `llm` (specmoe.LLM). Starts its engine thread on startup and
    stops it on shutdown.

    Args:
        served_model_name: the `model` clients must pass.
        api_key: bearer token required on every route but /health (None: no key).
        max_waiting: requests that may wait for a slot before new ones get 429.
        drain_timeout_s: seconds in-flight requests get to finish on shutdown.
        max_request_bytes: largest request body in bytes; a larger one gets 413 before it
            is parsed (checked from Content-Length and by counting a chunked body).
    Raises:
        ValueError: max_waiting < 1, max_request_bytes < 1, or an api_key no HTTP client
            can send (`check_api_key`).
    """
    check_api_key(api_key)
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) \
            or max_request_bytes < 1:
        raise ValueError(f"invalid max_request_bytes={max_request_bytes!r}: must be an int "
                         ">= 1")
    metrics = ServerMetrics(served_model_name)
    metrics.attach_expert_load(llm.target.model)
    metrics.attach_expert_parallel(llm.target)
    engine = AsyncEngine(llm, max_waiting=max_waiting, observer=metrics)
    state = ServerState(engine, OpenAIServing(engine, served_model_name), metrics, api_key,
                        drain_timeout_s, max_request_bytes=max_request_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:  # also when the code run inside the lifespan raises (an in-process test)
            state.is_draining = True
            await engine.shutdown(timeout_s=0.0)
            state.serving.close()

    app = FastAPI(title="specmoe", lifespan=lifespan)
    app.state.specmoe = state
    _add_routes(app, state)
    _add_error_handlers(app)
    app.add_middleware(GuardMiddleware, state=state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    serving = state.serving

    @app.get("/health", responses={503: {"description": "draining (shutting down), or an "
                                                        "expert-parallel rank failed"}})
    async def health() -> JSONResponse:
        if state.is_draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        failure = serving.llm.target.failure  # expert parallelism
        if failure is not None:
            return JSONResponse({"status": "failed", "error": str(failure)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse, responses=_GET_RESPONSES)
    async def metrics() -> Response:
        state.metrics.in_flight.labels(serving.model_name).set(state.num_in_flight)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses={200: {"model": P.ModelList}, **_GET_RESPONSES})
    async def models() -> JSONResponse:
        card = P.ModelCard(id=serving.model_name, max_model_len=serving.llm.max_model_len)
        return JSONResponse(P.ModelList(data=[card]).model_dump())

    @app.post("/v1/completions", responses={
        **_success(P.CompletionResponse, "the completion (stream=false), or its chunks"),
        **_GENERATION_RESPONSES})
    async def completions(body: P.CompletionRequest, raw: HTTPRequest):
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions", responses={
        **_success(P.ChatCompletionResponse,
                   "the chat completion (stream=false), or its ChatCompletionChunk events"),
        **_GENERATION_RESPONSES})
    async def chat_completions(body: P.ChatCompletionRequest, raw: HTTPRequest):
        return await serving.chat_completions(body, raw)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError) -> JSONResponse:
        return validation_api_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException) -> JSONResponse:
        response = APIError(exc.status_code, str(exc.detail)).response()
        # Starlette's own headers go out too: a 405 must list the route's methods in Allow
        # (RFC 9110, 15.5.6).
        response.headers.update(exc.headers or {})
        return response
    # Other exceptions are answered (500) by GuardMiddleware, inside the counting of
    # responses: Starlette's own handler for them sends outside every middleware.


def _short_repr(value, limit: int = 200) -> str:
    """repr(value) cut to about `limit` characters, without building the repr of a huge
    prompt first."""
    short = _SHORT.repr(value)
    return short if len(short) <= limit else short[:limit] + "..."


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 160, 160, 8, 8


def validation_api_error(errors: list[dict]) -> APIError:
    """A 400 naming the first invalid field (dotted path), its value and the rule broken."""
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    # union members add their type name to the path; drop those segments
    loc = [x for x in loc if not (x in {"str", "int", "list[str]", "list[int]",
                                        "list[list[int]]", "list[TextPart]", "StreamOptions"}
                                  or x.startswith(("function-", "json-")))]
    if err.get("type") == "json_invalid":
        return APIError(400, f"invalid JSON body: {err.get('msg')}", None)
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None and err.get("type") in _BODY_TYPE_ERRORS:
        return APIError(400, f"invalid request body: {msg} (send a JSON object with "
                             "'Content-Type: application/json')", None)
    if param is None:
        return APIError(400, f"invalid request: {msg}", None)
    shown = "" if err.get("type") == "missing" else "=" + _short_repr(err.get("input"))
    return APIError(400, f"invalid {param}{shown}: {msg}", param)



class _BodyTooLarge(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class GuardMiddleware:
    """API key check, 503 while draining, the body-size limit (413), in-flight count, an
    OpenAI-shaped 500 for an unhandled exception, and per-status counts of /v1 responses
    (pure ASGI, so streaming responses are counted until their last byte)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = self.state, scope["path"]
        if path.startswith("/v1/"):
            send = self._counting(send)
        if path != "/health" and state.api_key and not self._authorized(scope):
            return await self._reject(send, APIError(
                401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                None, "invalid_api_key"))
        is_generation = path.startswith("/v1/") and scope["method"] == "POST"
        if is_generation and state.is_draining:
            return await self._reject(send, APIError(503, "the server is shutting down", None,
                                                     "shutting_down"))
        if scope["method"] in ("POST", "PUT", "PATCH"):
            try:
                receive = await self._buffered(scope, receive)
            except _BodyTooLarge as exc:
                return await self._reject(send, self._too_large(exc.size))
        if not is_generation:
            return await self._serve(scope, receive, send)
        state.num_in_flight += 1
        state.idle.clear()
        try:
            await self._serve(scope, receive, send)
        finally:
            state.num_in_flight -= 1
            if state.num_in_flight == 0:
                state.idle.set()

    async def _serve(self, scope, receive, send) -> None:
        """Run the app; an exception before the response started is answered here with an
        OpenAI-shaped 500 (so it is counted); one after it started is re-raised."""
        started = False

        async def tracking(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error on %s %s", scope["method"], scope["path"])
            await self._reject(send, APIError(
                500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error"))

    async def _buffered(self, scope, receive):
        """Read the whole body, counting bytes, and return a `receive` that replays it.

        Raises:
            _BodyTooLarge: Content-Length, or the bytes received so far, exceed the limit
                (nothing more is read then).
        """
        limit = self.state.max_request_bytes
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            raise _BodyTooLarge(int(length))
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnected: let the app see it
                return _replay([], receive, first=message)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise _BodyTooLarge(size)
            more = message.get("more_body", False)
        return _replay(chunks, receive)

    def _too_large(self, size: int) -> APIError:
        limit = self.state.max_request_bytes
        return APIError(413, f"the request body has {size} bytes (at least); this server "
                             f"accepts at most {limit} bytes (--max-request-bytes)", None,
                        "request_too_large")

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        expected = f"Bearer {self.state.api_key}"
        return hmac.compare_digest(given.encode(), expected.encode())

    def _counting(self, send):
        counter = self.state.metrics.http_responses

        async def wrapped(message) -> None:
            if message["type"] == "http.response.start":
                counter.labels(str(message["status"])).inc()
            await send(message)
        return wrapped

    @staticmethod
    async def _reject(send, error: APIError) -> None:
        response = error.response()
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


def _replay(chunks: list[bytes], receive, first: dict | None = None):
    """An ASGI `receive` giving `first` (or the buffered body, in one message) once, then
    the real `receive` (which reports the client's disconnect)."""
    pending = [first or {"type": "http.request", "body": b"".join(chunks),
                         "more_body": False}]

    async def replay() -> dict:
        return pending.pop() if pending else await receive()
    return replay


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful first signal: stop admissions, wait for in-flight
    requests (up to the state's drain timeout), then exit normally (status 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.state.is_draining or self._loop is None:
            # At once: os._exit, because interpreter shutdown while the engine thread is
            # inside a torch op ends in std::terminate (SIGABRT).
            logger.warning("signal %s again: exiting now without draining", sig)
            os._exit(1)
        logger.info("signal %s: draining (up to %.0f s), then exiting", sig,
                    self.state.drain_timeout_s)
        self.state.is_draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        state = self.state
        state.engine.stop_accepting()
        try:
            if state.num_in_flight:
                await asyncio.wait_for(state.idle.wait(), state.drain_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("drain timeout: %d requests still in flight are aborted",
                           state.num_in_flight)
            state.engine.abort_all()  # their streams end with finish_reason "abort"
            try:
                await asyncio.wait_for(state.idle.wait(), ABORT_GRACE_S)
            except asyncio.TimeoutError:
                logger.warning("%d aborted requests did not finish their responses",
                               state.num_in_flight)
        self.should_exit = True


@dataclass
class ServeConfig:
    """Options of `specmoe serve` (see the CLI for their meaning)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_waiting: int = 256
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


def check_api_key(api_key: str | None) -> None:
    """Raise ValueError for a key that cannot travel in an Authorization header: HTTP
    clients send header values as printable ASCII (a non-ASCII key starts a server no client
    can authenticate to). None (no key) passes."""
    if api_key is not None and not (api_key.isascii() and api_key.isprintable()
                                    and api_key.strip() == api_key):
        raise ValueError("invalid --api-key: it must be printable ASCII without leading or "
                         f"trailing spaces (HTTP headers carry no other), got {len(api_key)} "
                         "characters that are not")


def resolve_api_key(cfg: ServeConfig) -> str | None:
    """--api-key, else $SPECMOE_API_KEY, else None; checked (`check_api_key`)."""
    api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None
    check_api_key(api_key)
    return api_key


def served_name(model: str) -> str:
    """The `model` clients pass when --served-model-name is not given: an alias as it is,
    a path's last component (so the server's paths stay out of /v1/models, responses, error
    messages and metric labels)."""
    path = Path(model)
    return path.name if len(path.parts) > 1 or path.exists() else model


def run_server(llm, model_name: str, cfg: ServeConfig) -> None:
    """Serve `llm` until a signal; returns after a graceful drain. `model_name` (a path
    or an alias) is served as `served_name(model_name)` unless `cfg.served_model_name`."""
    app = build_app(llm, cfg.served_model_name or served_name(model_name),
                    resolve_api_key(cfg), cfg.max_waiting, cfg.drain_timeout_s,
                    cfg.max_request_bytes)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    with frozen_heap():  # the loaded engine lives as long as the server
        DrainingServer(config, app.state.specmoe).run()
