"""The OpenAI-compatible server end to end: real `specmoe serve` processes on loopback serving
the embedded SmolLM2-135M, driven by the official `openai` client and raw httpx.

Two servers start once for the module, in parallel: `main` (n-gram speculation K=4, an API
key, 2 running requests at most and a waiting queue of 1) and `drain` (plain, no key), which
the graceful-shutdown test stops with SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "smollm2-135m"
KEY = "test-key"
REPEAT = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"  # n-gram lookup drafts on this


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `specmoe serve` subprocess on a free loopback port."""

    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specmoe.entrypoints.cli", "serve", "--model", MODEL,
               "--port", str(self.port), "--threads", "1", "--max-model-len", "512",
               "--log-level", "warning", *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("SPECMOE_API_KEY", None)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n"
                                   f"{self.proc.stdout.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def servers(smollm2):
    main = Server("--draft", "ngram", "-k", "4", "--api-key", KEY, "--max-num-seqs", "2",
                  "--max-waiting", "1")
    drain = Server("--drain-timeout", "120", "--kv-cache-dtype", "int8", "--log-level", "info")
    try:
        main.wait_ready()
        drain.wait_ready()
        yield {"main": main, "drain": drain}
    finally:
        main.stop()
        drain.stop()


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["main"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as c:
        yield c


def _metrics(http) -> dict[str, float]:
    """Unlabelled-by-position samples of /metrics: name -> value (label sets summed)."""
    out: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def _wait_for(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


# ---- completions and chat ---------------------------------------------------------------


def test_completion_and_usage(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    assert "num_draft_tokens" in out.model_extra["spec_decode"]


def test_completion_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a prime number."}],
                  max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"


def test_n_choices_and_seed_reproducible(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0,
                  seed=7, n=2, extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 20
    streamed = list(client.completions.create(stream=True, **kwargs))
    for i in range(2):
        text = "".join(c.choices[0].text for c in streamed if c.choices[0].index == i)
        assert text == first.choices[i].text


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 2
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the argmax
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_stop_string(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=24,
                  temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    words = [w for w in full.split() if len(w) >= 3]
    assert words, full
    stop = words[min(1, len(words) - 1)]
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[:full.index(stop)]
    chunks = list(client.completions.create(stop=[stop], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == cut.text


def test_speculation_on_off_identical_greedy(client):
    kwargs = dict(model=MODEL, prompt=REPEAT, max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    spec = client.completions.create(**kwargs)
    plain = client.completions.create(**{**kwargs, "extra_body": {
        "ignore_eos": True, "num_speculative_tokens": 0}})
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.model_extra["spec_decode"]["num_draft_tokens"] > 0
    assert plain.model_extra["spec_decode"]["num_draft_tokens"] == 0


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


# ---- bad input ----------------------------------------------------------------------------

LONG_PROMPT = "hello " * 600  # > 512 tokens

BAD = [
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": "x", "n": 2.5}, "n"),
    ("completions", {"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "n": 1000}, "n"),
    ("completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "x", "seed": -1}, "seed"),
    ("completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("completions", {"prompt": "x", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ("completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"prompt": "x", "unknown_field": 1}, "unknown_field"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [10**9]}, "prompt"),
    ("completions", {"prompt": LONG_PROMPT}, "prompt"),
    ("completions", {}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]},
     "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p}:{pa}" for p, _, pa in BAD])
def test_bad_input_is_400_naming_the_field(http, path, body, param):
    resp = http.post(f"/v1/{path}", json={"model": MODEL, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param:
        assert param.split(".")[0] in error["message"]


def test_bad_json_unknown_model_and_server_keeps_serving(http, client):
    resp = http.post("/v1/completions", content=b"{not json",
                     headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    resp = http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=5)
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")


# ---- auth, queue, disconnect ---------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}],
                         ids=["missing", "wrong"])
def test_api_key_required_except_health(server, headers):
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
        assert c.get("/health").status_code == 200
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]:
            resp = c.request(method, path, json={"model": MODEL, "prompt": "x"})
            assert resp.status_code == 401, path
            assert resp.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def _open_stream(stack: contextlib.ExitStack, http, max_tokens: int):
    body = {"model": MODEL, "prompt": REPEAT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    resp = stack.enter_context(http.stream("POST", "/v1/completions", json=body))
    assert resp.status_code == 200
    return resp


def test_queue_full_429_and_disconnect_frees_kv_blocks(server, http):
    with contextlib.ExitStack() as stack:
        running = [_open_stream(stack, http, 400) for _ in range(2)]  # max_num_seqs = 2
        lines = [resp.iter_lines() for resp in running]  # (kept: closing one ends its stream)
        for it in lines:  # both produce tokens: both are running
            assert next(line for line in it if line.startswith("data:"))
        _open_stream(stack, http, 400)  # the third waits
        assert _wait_for(lambda: (m := _metrics(http))["specmoe:num_requests_waiting"] == 1
                         and m["specmoe:num_requests_running"] == 2)
        resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "rate_limit_error"
        assert _metrics(http)["specmoe:kv_cache_blocks_used"] > 0
    # every client disconnected mid-stream: their requests are aborted, blocks freed
    def all_free() -> bool:
        m = _metrics(http)
        return (m["specmoe:kv_cache_blocks_used"] == 0 and m["specmoe:num_requests_running"]
                == 0 and m["specmoe:num_requests_waiting"] == 0)
    assert _wait_for(all_free)
    assert _metrics(http)["specmoe:request_success_total"] >= 3  # aborts are counted
    out = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert out.status_code == 200


def test_metrics_names(server, http):
    body = {"model": MODEL, "prompt": REPEAT, "max_tokens": 16, "temperature": 0}
    assert http.post("/v1/completions", json=body).status_code == 200
    m = _metrics(http)
    for name in ["specmoe:num_requests_running", "specmoe:num_requests_waiting",
                 "specmoe:kv_cache_usage_perc", "specmoe:kv_cache_blocks_used",
                 "specmoe:prefix_cache_queries_total", "specmoe:prefix_cache_hits_total",
                 "specmoe:spec_decode_num_drafts_total",
                 "specmoe:spec_decode_num_draft_tokens_total",
                 "specmoe:spec_decode_num_accepted_tokens_total",
                 "specmoe:spec_decode_num_accepted_tokens_per_pos_total",
                 "specmoe:time_to_first_token_seconds_count",
                 "specmoe:time_per_output_token_seconds_count",
                 "specmoe:e2e_request_latency_seconds_count",
                 "specmoe:http_responses_total", "process_resident_memory_bytes"]:
        assert name in m, name
    assert m["specmoe:spec_decode_num_draft_tokens_total"] > 0
    assert m["specmoe:generation_tokens_total"] > 0


# ---- load generator ------------------------------------------------------------------------


def test_bench_serve_against_the_server(server):
    """`specmoe bench serve` on real prompts: every request answered, each with a time to
    first token (also those whose first token is the end of sequence), no key written."""
    import json

    from specmoe.bench.serve import ServeBenchConfig, render_markdown, run_serve_bench
    cfg = ServeBenchConfig(base_url=server.url + "/v1", api_key=KEY, endpoint="completions",
                           datasets=["mt_bench"], num_requests=4, concurrency=2,
                           max_tokens=8)  # MT-Bench: short prompts (the context is 512)
    results = run_serve_bench(cfg)
    s = results["summary"]
    assert (s["num_ok"], s["num_5xx"], s["errors"]) == (4, 0, {})
    assert s["ttft_s"]["n"] == 4 and s["e2e_s"]["n"] == 4
    assert KEY not in json.dumps(results)
    assert "| TTFT | 4 |" in render_markdown(results)


# ---- graceful shutdown ---------------------------------------------------------------------


def test_sigterm_finishes_in_flight_then_exits(servers):
    srv = servers["drain"]
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = c.completions.create(model=MODEL, prompt=REPEAT, max_tokens=64, temperature=0,
                                  stream=True, stream_options={"include_usage": True},
                                  extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    srv.proc.send_signal(signal.SIGTERM)
    assert _wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, 30)
    refused = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert refused.status_code == 503
    chunks += list(stream)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 64  # the whole request, not cut short
    assert srv.proc.wait(timeout=60) == 0
    # this server runs on an int8 KV cache and said so at start
    assert re.search(r"KV cache: int8 \(int8\), \d+ bytes per token", srv.proc.stdout.read())


def test_drain_timeout_aborts_the_rest_cleanly(smollm2):
    """Past --drain-timeout the requests still running end with finish_reason "abort"
    (the stream completes normally) and the server exits 0."""
    srv = Server("--drain-timeout", "1")
    try:
        srv.wait_ready()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                          timeout=120)
        stream = c.completions.create(model=MODEL, prompt=REPEAT, max_tokens=400,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        srv.proc.send_signal(signal.SIGTERM)
        chunks += list(stream)  # ends without a transport error
        assert chunks[-1].choices[0].finish_reason == "abort"
        assert sum(len(ch.choices[0].text) for ch in chunks) > 0
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()
