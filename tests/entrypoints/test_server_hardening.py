"""The server against hostile or careless clients, in process (issue 23): the real FastAPI app
over a tiny random Llama (no tokenizer, so prompts are token ids), driven through httpx's
ASGI transport. Internal errors, disconnects and slow tokenisation are forced by
monkeypatching; nothing here loads a real model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from specmoe import LLM  # noqa: E402
from specmoe.entrypoints.openai import protocol as P  # noqa: E402
from specmoe.entrypoints.openai import serving as S  # noqa: E402
from specmoe.entrypoints.openai.api_server import build_app  # noqa: E402
from tiny_models import save_tiny_llama  # noqa: E402

MODEL = "tiny"
PROMPT = [5, 6, 7]
LIMIT = 64 * 1024  # max_request_bytes of these apps


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    """A random 1-layer Llama, vocabulary 512, context 128, no tokenizer files."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_server"))
    return LLM(str(path), dtype="float32")


def serve(llm, scenario, **kwargs):
    """Run `await scenario(app, client)` against a fresh app over `llm` (its engine thread
    started and stopped around it); returns what the scenario returns."""
    async def main():
        app = build_app(llm, MODEL, max_request_bytes=LIMIT, **kwargs)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                         timeout=60) as client:
                return await scenario(app, client)
    return asyncio.run(main())


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **fields}


async def responses_counted(client, status: str) -> float:
    """specmoe:http_responses_total{status} from /metrics."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("specmoe:http_responses_total{") and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def assert_openai_error(resp, status: int, param: str | None, type_: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["param"] == param, error
    return error


# ---- D11, D13, D5: validation names the field ----------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BAD = [
    # D11: loose types are refused, not coerced
    ("completions", {"temperature": True}, "temperature"),
    ("completions", {"top_p": "0.5"}, "top_p"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"ignore_eos": "false"}, "ignore_eos"),
    ("completions", {"ignore_eos": 1}, "ignore_eos"),
    ("completions", {"min_p": False}, "min_p"),
    ("completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("chat/completions", {**CHAT, "logprobs": "true"}, "logprobs"),
    # D11: NaN and infinity (Python's JSON reads NaN and Infinity)
    ("completions", {"temperature": float("nan")}, "temperature"),
    ("completions", {"top_p": float("inf")}, "top_p"),
    ("completions", {"presence_penalty": float("nan")}, "presence_penalty"),
    # D13: cross-field rules name their field, with no Content-Type hint
    ("completions", {"best_of": 3}, "best_of"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    # D4: a lone surrogate cannot be encoded (the tokenizer raised a TypeError: a 500)
    ("completions", {"prompt": "hi \ud800 there"}, "prompt"),
    ("completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
    ("completions", {"stop": ["\ud800"]}, "stop"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
     "messages.0.content"),
    # D5: prompts x n above MAX_ENGINE_REQUESTS_PER_CALL
    ("completions", {"prompt": [PROMPT] * 17, "n": 16}, "prompt"),
    # issue 57 item 7: token ids are ints, not booleans or floats
    ("completions", {"prompt": [True]}, "prompt"),
    ("completions", {"prompt": [[True, False]]}, "prompt"),
    ("completions", {"prompt": [1.0]}, "prompt"),
    ("completions", {"prompt": [1e3]}, "prompt"),
]


@pytest.mark.parametrize("path,fields,param", BAD,
                         ids=[f"{p}:{json.dumps(f)[:40]}" for p, f, _ in BAD])
def test_bad_field_is_400_naming_it_without_a_content_type_hint(llm, path, fields, param):
    body = ({"model": MODEL, "prompt": PROMPT, **fields} if path == "completions"
            else {"model": MODEL, **fields})

    async def scenario(app, client):
        # json.dumps writes NaN and Infinity, as a careless client's JSON library does
        return await client.post(f"/v1/{path}", content=json.dumps(body),
                                 headers={"Content-Type": "application/json"})
    error = assert_openai_error(serve(llm, scenario), 400, param, "invalid_request_error")
    assert param.split(".")[0] in error["message"]
    assert "Content-Type" not in error["message"]


def test_engine_requests_cap_names_the_cap(llm):
    """D5: one request may not make more than MAX_ENGINE_REQUESTS_PER_CALL engine requests;
    exactly the cap is served."""
    cap = P.MAX_ENGINE_REQUESTS_PER_CALL

    async def scenario(app, client):
        over = await client.post("/v1/completions", json=completion(
            prompt=[PROMPT] * (cap // 8 + 1), n=8, max_tokens=1))
        at_cap = await client.post("/v1/completions", json=completion(
            prompt=[PROMPT] * (cap // 16), n=16, max_tokens=1))
        return over, at_cap
    over, at_cap = serve(llm, scenario)
    error = assert_openai_error(over, 400, "prompt", "invalid_request_error")
    assert str(cap) in error["message"] and str((cap // 8 + 1) * 8) in error["message"]
    assert at_cap.status_code == 200 and len(at_cap.json()["choices"]) == cap


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b""], ids=["list", "string", "empty"])
def test_a_body_that_is_not_an_object_keeps_the_content_type_hint(llm, body):
    async def scenario(app, client):
        return await client.post("/v1/completions", content=body,
                                 headers={"Content-Type": "application/json"})
    error = assert_openai_error(serve(llm, scenario), 400, None, "invalid_request_error")
    assert "Content-Type: application/json" in error["message"]


# ---- D12: max_tokens null on completions --------------------------------------------------


def test_completions_max_tokens_null_means_16(llm):
    async def scenario(app, client):
        null = await client.post("/v1/completions", json=completion(
            max_tokens=None, ignore_eos=True))
        absent = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "ignore_eos": True})
        return null.json(), absent.json()
    null, absent = serve(llm, scenario)
    assert null["usage"]["completion_tokens"] == 16, null
    assert absent["usage"]["completion_tokens"] == 16, absent


# ---- D8: an unhandled exception is an OpenAI-shaped 500, counted ---------------------------


def test_internal_error_is_an_openai_500_counted_once(llm, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    async def scenario(app, client):
        monkeypatch.setattr(app.state.specmoe.serving, "_fit", boom)
        before = await responses_counted(client, "500")
        resp = await client.post("/v1/completions", json=completion())
        return resp, await responses_counted(client, "500") - before
    with caplog.at_level(logging.ERROR, logger="specmoe.server"):
        resp, counted = serve(llm, scenario)
    error = assert_openai_error(resp, 500, None, "server_error")
    assert "RuntimeError: boom" in error["message"]
    assert counted == 1
    assert any("unhandled error" in r.getMessage() for r in caplog.records)  # logged once


# ---- D6: body-size limit and tokenisation off the event loop ------------------------------


def test_body_over_the_limit_is_413_and_the_server_goes_on(llm):
    big = json.dumps(completion(prompt=[5] * LIMIT)).encode()  # > LIMIT bytes

    async def chunked():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    async def scenario(app, client):
        sized = await client.post("/v1/completions", content=big,
                                  headers={"Content-Type": "application/json"})
        streamed = await client.post("/v1/completions", content=chunked(),
                                     headers={"Content-Type": "application/json"})
        after = await client.post("/v1/completions", json=completion())
        return sized, streamed, after, await responses_counted(client, "413")
    sized, streamed, after, counted = serve(llm, scenario)
    for resp in (sized, streamed):
        error = assert_openai_error(resp, 413, None, "invalid_request_error")
        assert error["code"] == "request_too_large"
        assert str(LIMIT) in error["message"]
    assert str(len(big)) in sized.json()["error"]["message"]  # from Content-Length
    assert "transfer-encoding" in {k.lower() for k in streamed.request.headers}
    assert after.status_code == 200
    assert counted == 2


def test_health_answers_while_a_prompt_is_tokenized(llm, monkeypatch):
    """make_request (tokenisation and prompt checks) sleeps 1 s in its thread: /health and
    the loop must not wait for it."""
    real = llm.make_request
    started, window = threading.Event(), {}

    def slow_make_request(*args, **kwargs):
        if not started.is_set():
            window["start"] = time.monotonic()
            started.set()
            time.sleep(1.0)
            window["end"] = time.monotonic()
        return real(*args, **kwargs)
    monkeypatch.setattr(llm, "make_request", slow_make_request)

    async def scenario(app, client):
        pending = asyncio.ensure_future(client.post("/v1/completions", json=completion()))
        while not started.is_set():
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        health = await client.get("/health")
        t1 = time.monotonic()
        return health, t0, t1, await pending
    health, t0, t1, done = serve(llm, scenario)
    assert health.status_code == 200
    assert t1 - t0 < 0.5 and t1 < window["end"], (t1 - t0, window)
    assert done.status_code == 200


def test_health_is_503_once_an_expert_parallel_rank_failed(llm, monkeypatch):
    """A failed expert-parallel group (`ExpertParallelRunner.failure`) fails every request,
    so /health tells the load balancer."""
    from specmoe.layers.moe.expert_parallel import RankFailure

    async def scenario(app, client):
        ok = await client.get("/health")
        monkeypatch.setattr(llm.target, "failure", RankFailure("rank 1 timed out"),
                            raising=False)
        return ok, await client.get("/health")
    ok, failed = serve(llm, scenario)
    assert ok.status_code == 200
    assert failed.status_code == 503
    assert failed.json() == {"status": "failed", "error": "rank 1 timed out"}


@pytest.mark.parametrize("stream", [False, True])
def test_requests_to_a_failed_expert_parallel_group_are_503_before_any_stream(
        llm, monkeypatch, stream):
    """A streaming request too gets the status, not a 200 and an error event."""
    from specmoe.layers.moe.expert_parallel import RankFailure

    async def scenario(app, client):
        monkeypatch.setattr(llm.target, "failure", RankFailure("rank 1 timed out"),
                            raising=False)
        return await client.post("/v1/completions", json=completion(stream=stream))
    error = assert_openai_error(serve(llm, scenario), 503, None, "service_unavailable")
    assert error["code"] == "engine_failed" and "rank 1 timed out" in error["message"]


@pytest.mark.parametrize("key", ["clé", "key\n", " key", "k\u00a0y"])
def test_an_api_key_no_client_can_send_is_refused(llm, key):
    with pytest.raises(ValueError, match="invalid --api-key: it must be printable ASCII"):
        build_app(llm, MODEL, api_key=key)


def test_served_name_of_a_path_is_its_last_component(tmp_path):
    from specmoe.entrypoints.openai.api_server import served_name
    assert served_name(str(tmp_path / "models" / "Qwen3-MoE")) == "Qwen3-MoE"
    assert served_name(str(tmp_path / "m.gguf")) == "m.gguf"
    assert served_name("tiny-moe") == "tiny-moe"


def test_adaptive_policy_refuses_a_request_k_above_its_own(llm):
    """The static policy honours any per-request K (up to the protocol's 16); the adaptive
    one drafts at most its K, so a larger one is a 400 naming the cap, not a silent cut."""
    adaptive = llm.with_speculative({"method": "ngram", "num_speculative_tokens": 3,
                                     "policy": "adaptive"})

    async def scenario(app, client):
        return (await client.post("/v1/completions", json=completion(num_speculative_tokens=8)),
                await client.post("/v1/completions", json=completion(num_speculative_tokens=3)))
    refused, ok = serve(adaptive, scenario)
    error = assert_openai_error(refused, 400, "num_speculative_tokens", "invalid_request_error")
    assert "num_speculative_tokens=8" in error["message"] and "at most 3" in error["message"]
    assert ok.status_code == 200
    static = llm.with_speculative({"method": "ngram", "num_speculative_tokens": 3})
    assert serve(static, lambda app, client: client.post(
        "/v1/completions", json=completion(num_speculative_tokens=8))).status_code == 200


# ---- D9: a non-streaming client disconnect ends quietly -----------------------------------


def test_disconnect_aborts_quietly(llm, monkeypatch, caplog):
    from starlette.requests import Request

    async def disconnected(self) -> bool:
        return True
    real_step = llm.step

    def slow_step():
        time.sleep(0.02)
        return real_step()
    monkeypatch.setattr(Request, "is_disconnected", disconnected)
    monkeypatch.setattr(S, "DISCONNECT_POLL_S", 0.05)
    monkeypatch.setattr(llm, "step", slow_step)  # 100 tokens: 2 s unless aborted

    async def scenario(app, client):
        engine = app.state.specmoe.engine
        resp = await client.post("/v1/completions", json=completion(
            max_tokens=100, ignore_eos=True, n=2))
        deadline = time.monotonic() + 1.0
        while engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return resp, engine.num_in_flight, llm.engine.has_unfinished_requests
    with caplog.at_level(logging.INFO):
        resp, in_flight, unfinished = serve(llm, scenario)
    assert resp.status_code == S.CLIENT_CLOSED_STATUS
    assert (in_flight, unfinished) == (0, False)  # both choices aborted at once
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("disconnected" in r.getMessage() for r in caplog.records)


# ---- D10: continuous usage statistics -----------------------------------------------------


def _events(text: str) -> list:
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("include_usage", [False, True])
def test_continuous_usage_stats_on_every_chunk(llm, include_usage):
    opts = {"continuous_usage_stats": True, "include_usage": include_usage}

    async def scenario(app, client):
        return await client.post("/v1/completions", json=completion(
            max_tokens=6, ignore_eos=True, n=2, stream=True, logprobs=0, stream_options=opts))
    chunks = _events(serve(llm, scenario).text)
    assert chunks and all("usage" in c for c in chunks)
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[0] >= 1 and done[-1] == 12
    assert all(c["usage"]["prompt_tokens"] == len(PROMPT) for c in chunks)
    assert all(c["usage"]["total_tokens"] == len(PROMPT) + c["usage"]["completion_tokens"]
               for c in chunks)
    assert (chunks[-1]["choices"] == []) == include_usage  # the final usage-only chunk


def test_no_usage_on_chunks_without_continuous_stats(llm):
    async def scenario(app, client):
        return await client.post("/v1/completions", json=completion(
            max_tokens=3, stream=True, logprobs=0, stream_options={"include_usage": True}))
    chunks = _events(serve(llm, scenario).text)
    assert all("usage" not in c for c in chunks[:-1]) and "usage" in chunks[-1]
