"""The server's request schema under fuzzing (issue 23, item 5): hypothesis bodies in process,
and schemathesis against a live server, both over one tiny random model.

1. hypothesis builds POST /v1/completions and /v1/chat/completions bodies: valid requests,
   then up to three mutations (a field of the wrong type, NaN and Infinity written as raw
   JSON, lone surrogates such as "\\ud800", huge ints such as 2**63 or 5000 digits, empty
   lists, unknown fields, nested garbage, a missing field, a body that is no object, broken
   bytes or another Content-Type). The real app answers each one through httpx's ASGI
   transport (one app per test, its engine thread running throughout). Properties: no
   status >= 500; every non-200 is OpenAI's error body, its `param` a field of the request;
   a valid body gets a 200 with one choice per prompt and n; a fixed greedy request sent
   alongside every fuzzed one gets the same tokens as when it ran alone; at the end the KV
   cache has every block back.
2. schemathesis loads /openapi.json from a uvicorn server on a free 127.0.0.1 port and sends
   what the schema allows and what it forbids, checking that no response is a server error
   and that every status, content type, header and body is the one the schema declares.

The model is a random 1-layer Llama with the tiny-moe fixture's tokenizer and chat template
(vocabulary 4096), so text prompts, chat and stop strings reach the engine; n-gram
speculation (K=3) is on. Examples are derandomized (the same on every run) and bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
httpx = pytest.importorskip("httpx")
schemathesis = pytest.importorskip("schemathesis")

import uvicorn  # noqa: E402
from hypothesis import HealthCheck, example, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

import specmoe  # noqa: E402
from specmoe import LLM  # noqa: E402
from specmoe.entrypoints.openai import protocol as P  # noqa: E402
from specmoe.entrypoints.openai.api_server import build_app  # noqa: E402
from specmoe.entrypoints.openai.serving import APIError  # noqa: E402
from tiny_models import save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
VOCAB_SIZE = 4096  # the tiny-moe tokenizer's
MAX_MODEL_LEN = 128
LIMIT = 64 * 1024  # max_request_bytes of these apps
# The same examples on every run (CI reproduces a failure); no database in the checkout.
FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    """A random 1-layer Llama with the tiny-moe tokenizer files, n-gram speculation K=3."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_fuzz_server"),
                           vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_MODEL_LEN,
                           bos_token_id=None, eos_token_id=0)
    tokenizer = Path(specmoe.__file__).parent / "models_data" / "tiny-moe"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer / name, path / name)
    return LLM(str(path), dtype="float32",
               speculative={"method": "ngram", "num_speculative_tokens": 3})


def assert_kv_cache_free(llm: LLM, timeout_s: float = 10.0) -> None:
    """Every KV cache block is back (the engine thread frees the last ones shortly after
    their responses end)."""
    kv_cache = llm.engine.scheduler.kv_cache
    deadline = time.monotonic() + timeout_s
    while kv_cache.num_free_blocks != kv_cache.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_cache.num_free_blocks == kv_cache.num_blocks


# ---- request bodies ----------------------------------------------------------------------

HUGE_INT = "@@huge-int@@"  # a string the encoder replaces by a 5000-digit JSON number
LONE_SURROGATES = ["\ud800", "a\udfffb", "\udc00\ud800"]
# Text without lone surrogates, short enough that any valid request fits in the context
# (at most 4 tokens a character with this byte-level tokenizer).
TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=6)
TOKEN_IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=8)

LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.sampled_from([2**63, -2**63 - 1, 2**64, 10**30, -1, 0, VOCAB_SIZE, HUGE_INT]),
    st.floats(), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e-39, -0.0]),
    st.text(max_size=4), st.sampled_from(["", " ", *LONE_SURROGATES, "tiny", "text"]))
GARBAGE = st.recursive(LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)
# What a field most often gets wrong, drawn as often as everything else together.
NASTY = st.sampled_from([float("nan"), float("inf"), -float("inf"), *LONE_SURROGATES, 2**63,
                         HUGE_INT, -1, 0, 1e-39, True, None, "", [], {}, [[]], [None]])
UNKNOWN_NAMES = st.one_of(st.text(max_size=8), st.sampled_from([*LONE_SURROGATES, "best_of ",
                                                               "Model", "functions"]))

# Fields of both endpoints with values the server must serve.
COMMON = {
    "temperature": st.one_of(st.just(0), st.floats(0.05, 2.0)),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.none(), TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "num_speculative_tokens": st.one_of(st.none(), st.integers(0, P.MAX_SPECULATIVE_TOKENS)),
    "user": st.one_of(st.none(), TEXT),
    "frequency_penalty": st.just(0), "presence_penalty": st.just(0.0),
    "logit_bias": st.one_of(st.none(), st.just({})),
}


@st.composite
def stream_fields(draw) -> dict:
    if not draw(st.booleans()):
        return {}
    fields = {"stream": True}
    if draw(st.booleans()):
        fields["stream_options"] = draw(st.fixed_dictionaries({}, optional={
            "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}))
    return fields


@st.composite
def valid_completion(draw) -> dict:
    """A /v1/completions body the server must serve (200)."""
    n = draw(st.integers(1, 3))
    one = st.one_of(TEXT, TOKEN_IDS)
    body = {"model": MODEL, "prompt": draw(st.one_of(one, st.lists(TEXT, min_size=1, max_size=3),
                                                    st.lists(TOKEN_IDS, min_size=1, max_size=3))),
            "n": n, **draw(st.fixed_dictionaries({}, optional={
                **COMMON, "max_tokens": st.one_of(st.none(), st.integers(1, 8)),
                "logprobs": st.one_of(st.none(), st.integers(0, 5)), "best_of": st.just(n),
                "echo": st.just(False), "suffix": st.none()})), **draw(stream_fields())}
    return body


@st.composite
def valid_chat(draw) -> dict:
    """A /v1/chat/completions body the server must serve (200)."""
    content = st.one_of(TEXT, st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": TEXT}), min_size=1, max_size=2))
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
         "content": content}, optional={"name": st.one_of(st.none(), TEXT)})
    body = {"model": MODEL, "messages": draw(st.lists(message, min_size=1, max_size=2)),
            "n": draw(st.integers(1, 3)), **draw(st.fixed_dictionaries({}, optional={
                **COMMON, "max_tokens": st.one_of(st.none(), st.integers(1, 8)),
                "max_completion_tokens": st.one_of(st.none(), st.integers(1, 8))})),
            **draw(stream_fields())}
    if draw(st.booleans()):
        body["logprobs"] = True
        body.update(draw(st.fixed_dictionaries({}, optional={"top_logprobs": st.integers(0, 5)})))
    return body


def mutate(draw, body: dict):
    """One careless or hostile change to `body` (which it may replace)."""
    kind = draw(st.sampled_from(["field"] * 4 + ["nested"] * 3 + ["unknown"] * 2
                                + ["delete", "body"]))
    if kind == "body":
        return draw(GARBAGE)
    if not isinstance(body, dict) or not body:
        return body
    if kind == "field":  # a known field, or one the other endpoint has, gets any value
        name = draw(st.sampled_from(sorted({*body, *P.CompletionRequest.model_fields,
                                            *P.ChatCompletionRequest.model_fields})))
        body[name] = draw(NASTY | GARBAGE)
    elif kind == "unknown":
        body[draw(UNKNOWN_NAMES)] = draw(GARBAGE)
    elif kind == "delete":
        del body[draw(st.sampled_from(sorted(body)))]
    else:  # inside a list or object value: an element replaced, added, or emptied
        name = draw(st.sampled_from(sorted(body)))
        value = body[name]
        if isinstance(value, list) and value:
            index = draw(st.integers(0, len(value) - 1))
            target = value[index]
            if isinstance(target, dict) and target:
                target[draw(st.sampled_from(sorted(target)))] = draw(NASTY | GARBAGE)
            else:
                value[index] = draw(NASTY | GARBAGE)
        elif isinstance(value, list):
            value.append(draw(GARBAGE))
        else:
            body[name] = draw(st.sampled_from([[], {}, [[]], [None], [float("nan")]]))
    return body


def encode(draw, body) -> tuple[bytes, dict, bool]:
    """The bytes and headers a client sends, and whether they were damaged: json.dumps
    writes NaN, Infinity and "\\ud800" escapes as a careless client's JSON library does;
    sometimes the bytes are cut or hold invalid UTF-8, or the Content-Type is not JSON."""
    raw = json.dumps(body).replace(f'"{HUGE_INT}"', "9" * 5000).encode()
    damage = draw(st.sampled_from(["none"] * 8 + ["cut", "bad-utf8", "content-type"]))
    headers = {"Content-Type": "application/json"}
    if damage == "cut":
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif damage == "bad-utf8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + raw[at:]
    elif damage == "content-type":
        headers = draw(st.sampled_from([{"Content-Type": "text/plain"}, {}]))
    return raw, headers, damage != "none"


@st.composite
def fuzzed_requests(draw, valid) -> tuple[object, bytes, dict, bool]:
    """(body, bytes, headers, is_valid): a valid body, then 0-3 mutations, then encoded."""
    body = draw(valid)
    num_mutations = draw(st.integers(0, 3))
    for _ in range(num_mutations):
        body = mutate(draw, body)
    raw, headers, damaged = encode(draw, body)
    return body, raw, headers, num_mutations == 0 and not damaged


def as_request(body) -> tuple[object, bytes, dict, bool]:
    """An explicit example for `fuzzed_requests`: `body` as JSON, not expected valid."""
    raw = json.dumps(body).replace(f'"{HUGE_INT}"', "9" * 5000).encode()
    return body, raw, {"Content-Type": "application/json"}, False


NAN, INF = float("nan"), float("inf")
# Known nasties, always sent first (hypothesis' explicit examples) besides the random ones.
COMPLETION = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
EXPLICIT = {
    "/v1/completions": [
        {**COMPLETION, "temperature": NAN}, {**COMPLETION, "top_p": INF},
        {**COMPLETION, "min_p": -INF}, {**COMPLETION, "seed": 2**63},
        {**COMPLETION, "n": 2**63}, {**COMPLETION, "max_tokens": HUGE_INT},
        {**COMPLETION, "prompt": []}, {**COMPLETION, "prompt": [[]]},
        {**COMPLETION, "prompt": "\ud800"}, {**COMPLETION, "prompt": ["a", "b\udfff"]},
        {**COMPLETION, "prompt": [VOCAB_SIZE]}, {**COMPLETION, "prompt": [-1]},
        {**COMPLETION, "prompt": [2**63]}, {**COMPLETION, "prompt": [HUGE_INT]},
        {**COMPLETION, "prompt": [[1, 2], "mixed"]}, {**COMPLETION, "stop": ["\ud800"]},
        {**COMPLETION, "stop_token_ids": [2**63]}, {**COMPLETION, "logprobs": 2**63},
        {**COMPLETION, "\ud800": 1}, {**COMPLETION, "user": "\ud800"},
        {**COMPLETION, "stream": True, "stream_options": {"include_usage": NAN}},
        {**COMPLETION, "logit_bias": {"1": NAN}}, {**COMPLETION, "top_k": 2**63},
        {**COMPLETION, "num_speculative_tokens": 2**63}, {**COMPLETION, "temperature": 1e-39},
        {**COMPLETION, "model": "\ud800"},
        [], None, NAN, "\ud800", {}],
    "/v1/chat/completions": [
        {**CHAT, "messages": []}, {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
        {**CHAT, "messages": [{"role": "user", "content": []}]},
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {**CHAT, "messages": [{"role": "tool", "content": "hi"}]},
        {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "\udc00"}]},
        {**CHAT, "messages": [[]]}, {**CHAT, "messages": [{"role": "user", "content": NAN}]},
        {"model": MODEL, "messages": CHAT["messages"], "max_completion_tokens": 2**63},
        {**CHAT, "max_tokens": HUGE_INT},
        {**CHAT, "logprobs": True, "top_logprobs": NAN}, {**CHAT, "top_logprobs": 2},
        {**CHAT, "temperature": INF}, {**CHAT, "n": 0}, {**CHAT, "seed": -2**63 - 1},
        {**CHAT, "stop": [""]}, {**CHAT, "\ud800": {"nested": [NAN]}}, [], None, {}],
}


# ---- response properties -----------------------------------------------------------------


def sse_chunks(resp) -> list[dict]:
    """The JSON chunks of a streamed response, which must end with `data: [DONE]` and hold
    no error event."""
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [e for e in resp.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks
    return chunks


def choice_indices(resp) -> list[int]:
    """The choice indices of a 200, streamed or not (each at least once)."""
    if resp.headers["content-type"].startswith("text/event-stream"):
        chunks = sse_chunks(resp)
        return sorted({c["index"] for chunk in chunks for c in chunk["choices"]})
    return [c["index"] for c in resp.json()["choices"]]


def expected_choices(body: dict) -> int:
    prompts = P.num_prompts(body["prompt"]) if "prompt" in body else 1
    return prompts * body.get("n", 1)


def check_response(resp, body, is_valid: bool, fields: set[str]) -> None:
    """The properties every answer to a fuzzed request has; `fields` are those the error's
    param may name without the client sending them (required ones, defaults that count)."""
    assert resp.status_code < 500, resp.text
    if resp.status_code == 200:
        indices = choice_indices(resp)
        assert indices and indices == list(range(len(indices))), indices
        if is_valid:
            assert len(indices) == expected_choices(body)
        return
    assert not is_valid, f"a valid request was refused: {resp.text}"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == APIError.TYPES.get(resp.status_code, "error"), error
    if error["param"] is not None:
        check_param(error, set(body) if isinstance(body, dict) else set(), fields)


def check_param(error: dict, sent: set[str], fields: set[str]) -> None:
    """`param` names a field of the request, and the field the message blames."""
    param, message = error["param"], error["message"]
    # a dotted path into a field; or an unknown field, whose name may hold a dot
    assert param.split(".")[0] in sent | fields or param in sent, error
    # chat's prompt is its templated messages
    if message.startswith("invalid ") and not (message.startswith("invalid prompt")
                                               and param == "messages"):
        after = message.removeprefix(f"invalid {param}")
        assert after != message and not (after[:1].isalnum() or after[:1] == "_"), error


# ---- 1. hypothesis bodies against the app in process ---------------------------------------

NEIGHBOUR = {"model": MODEL, "prompt": [10, 20, 30, 40, 10, 20, 30], "max_tokens": 8,
             "temperature": 0, "ignore_eos": True, "logprobs": 0}


async def neighbour_tokens(client) -> list[str]:
    resp = await client.post("/v1/completions", json=NEIGHBOUR)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


def fuzz_app(llm, check) -> None:
    """Run `check(send)` in a worker thread against one app over `llm`, its engine thread
    running throughout; `send(coroutine_function)` awaits `coroutine_function(client)` on
    the app's event loop and returns its result. Every KV block must be back after."""
    async def main():
        app = build_app(llm, MODEL, max_request_bytes=LIMIT)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                         timeout=60) as client:
                loop = asyncio.get_running_loop()

                def send(fn):
                    return asyncio.run_coroutine_threadsafe(fn(client), loop).result(120)
                # hypothesis runs synchronously: in a worker thread, not on the app's loop
                await asyncio.to_thread(check, send)
            assert_kv_cache_free(llm)
    asyncio.run(main())


def fuzz_endpoint(llm, path: str, valid, fields: set[str], max_examples: int) -> None:
    """Fuzzed bodies for `path`, each sent together with the greedy neighbour; `fields` as
    in `check_response`."""

    def check(send):
        reference = send(neighbour_tokens)

        @settings(FUZZ, max_examples=max_examples)
        @given(request=fuzzed_requests(valid))
        def one(request):
            body, raw, headers, is_valid = request
            note(f"sent {raw[:500]!r} {headers}")

            async def both(client):
                return await asyncio.gather(
                    client.post(path, content=raw, headers=headers), neighbour_tokens(client))
            resp, neighbour = send(both)
            check_response(resp, body, is_valid, fields)
            assert neighbour == reference, "a fuzzed request changed its neighbour's tokens"
        for body in EXPLICIT[path]:
            one = example(request=as_request(body))(one)
        one()
    fuzz_app(llm, check)


def test_fuzzed_completions_never_fail_the_server_or_a_neighbour(llm):
    # max_tokens: its default (16) may not fit the context
    fuzz_endpoint(llm, "/v1/completions", valid_completion(), {"model", "prompt", "max_tokens"},
                  120)


def test_fuzzed_chat_completions_never_fail_the_server_or_a_neighbour(llm):
    fuzz_endpoint(llm, "/v1/chat/completions", valid_chat(), {"model", "messages"}, 60)


# ---- 2. schemathesis against a live server -------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(llm):
    """The app over `llm` served by uvicorn (a thread of this process) on a free loopback
    port; yields its URL. Stops it after, then every KV block must be back."""
    app = build_app(llm, MODEL, max_request_bytes=LIMIT)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="fuzz-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert_kv_cache_free(llm)


def call_and_validate(case) -> None:
    """Send `case` and run schemathesis' checks on the answer.

    positive_data_acceptance is left out: it expects every schema-valid body to be served,
    but validity here also depends on the model and on other fields, which a JSON schema
    does not express (token ids within the vocabulary, a prompt that fits the context with
    max_tokens, best_of == n, top_logprobs only with logprobs=true, non-empty prompts and
    stop strings); such bodies get a 400 naming the field, which the in-process fuzzing
    above checks. Every other check runs: no 5xx, and every status, content type, header
    and body (200 and errors) as the schema declares; schema-invalid data refused with a 4xx;
    an undeclared method answered 405 with an Allow header.
    """
    meta = case.meta
    if meta is not None and meta.generation.mode.is_positive and isinstance(case.body, dict):
        # the only model this server knows: valid bodies then reach the engine, not a 404
        case.body["model"] = MODEL
    case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=60)


OPERATIONS = {"GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions",
              "POST /v1/chat/completions"}


def test_server_conforms_to_its_openapi_schema(llm):
    """schemathesis' coverage cases (each field's boundaries and wrong types, missing
    fields, undeclared methods) and fuzzed ones (positive and negative) for every
    operation of /openapi.json, sent to a live server."""
    with live_server(llm) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=30)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.label for op in operations} == OPERATIONS
        for operation in operations:
            for case in schema.iter_coverage_cases(
                    operation, generation_modes=list(GenerationMode),
                    generation_config=schema.config.generation_for(operation=operation)):
                call_and_validate(case)
            # a route without parameters or body has nothing to make invalid
            has_input = bool(operation.body) or any(operation.iter_parameters())
            for mode in GenerationMode if has_input else [GenerationMode.POSITIVE]:
                fuzz_operation(operation, mode)


def fuzz_operation(operation, mode) -> None:
    @settings(FUZZ, max_examples=25)
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        call_and_validate(case)
    fuzz()
