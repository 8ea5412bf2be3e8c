"""`specmoe bench serve --chaos RATE`: a soak that mixes hostile clients into valid traffic and
checks at the end that none of them hurt anyone else.

Each request of the load is, with probability RATE (a seeded draw), a hostile action instead
of a valid streaming request; the hostile kinds take turns (HOSTILE_KINDS):

- bad bodies, each answered by a 4xx (EXPECTED_STATUS): invalid JSON, a wrong type
  (`"temperature": true`), a raw `NaN`, a lone surrogate ("\\ud800") in the prompt, an unknown
  field, a body one byte over the server's `--max-request-bytes` (413), and 2000 prompts x
  n=16 on /completions (over the per-request cap);
- a disconnect: a valid streaming request closed after its first events;
- a cancel: a valid non-streaming request whose client gives up after `cancel_after_s`.
  Disconnects and cancels have no response to check, only that none is a 5xx.

Before the load, a warm-up (one burst of `concurrency` valid requests and one request of each
hostile kind) reaches the server's steady state; its requests are checked like the others.
The checks (`Check`): every valid request succeeded (200 and no error event); no hostile
request got a 5xx; every bad body got its expected status; within `grace_s` seconds after
the load, /metrics shows the server idle (no request running, waiting or in flight, no KV
cache block in use); and resident memory (process_resident_memory_bytes) after the load
grew by at most max(RSS_GROWTH_LIMIT_BYTES, RSS_GROWTH_LIMIT_FRACTION x the value after the
warm-up). The 64 MiB floor absorbs allocator noise on a small server; 10% lets a large one
settle its caches, while a leak of a few KiB per request over a 10-minute soak (tens of
thousands of requests) still exceeds it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import httpx

from specmoe.bench.serve import (RequestResult, ServeBenchConfig, body_for, endpoint_url,
                                 first_model, open_client, prompt_texts, public_config,
                                 render_markdown, scrape, scrape_loop, send_all, send_burst,
                                 send_valid, summarize)

HOSTILE_KINDS = ("invalid_json", "wrong_type", "raw_nan", "lone_surrogate", "unknown_field",
                 "oversize_body", "too_many_choices", "disconnect", "cancel")
# What each bad body must get; disconnects and cancels are absent (nothing to check).
EXPECTED_STATUS = {"invalid_json": "4xx", "wrong_type": "4xx", "raw_nan": "4xx",
                   "lone_surrogate": "4xx", "unknown_field": "4xx", "oversize_body": "413",
                   "too_many_choices": "4xx"}
RSS_GROWTH_LIMIT_BYTES = 64 * 2**20
RSS_GROWTH_LIMIT_FRACTION = 0.10
CANCELLED = "cancelled by the client"
IDLE_POLL_S = 0.5
# The gauges that must read 0 once the server is idle; the KV gauges may be missing (another
# server), running and waiting may not.
IDLE_GAUGES = ("specmoe:num_requests_running", "specmoe:num_requests_waiting",
               "specmoe:num_requests_in_flight", "specmoe:kv_cache_blocks_used",
               "specmoe:kv_cache_usage_perc")
REQUIRED_GAUGES = ("specmoe:num_requests_running", "specmoe:num_requests_waiting")


@dataclass
class ChaosConfig:
    """The hostile side of a chaos run.

    Attributes:
        rate: fraction of requests that are hostile, in [0, 1].
        grace_s: seconds the server gets, after the load, to report itself idle.
        cancel_after_s: seconds after which a cancelling client gives up.
        disconnect_after_events: server-sent events a disconnecting client reads first.
        max_request_bytes: the server's body-size limit (`specmoe serve
            --max-request-bytes`, 4 MiB by default); the oversize body is one byte more.
    Raises:
        ValueError: a value out of range (rate outside [0, 1] or NaN, a time <= 0, ...).
    """

    rate: float = 0.0
    grace_s: float = 30.0
    cancel_after_s: float = 0.5
    disconnect_after_events: int = 2
    max_request_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:  # False for NaN too
            raise ValueError(f"invalid chaos rate={self.rate}: must be in [0, 1]")
        for name in ("grace_s", "cancel_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"invalid {name}={getattr(self, name)}: must be > 0")
        for name in ("disconnect_after_events", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"invalid {name}={getattr(self, name)}: must be >= 1")


@dataclass
class Check:
    """One end-of-run check: its name, whether it passed, and the figures behind it."""

    name: str
    ok: bool
    detail: str


def run_chaos_bench(cfg: ServeBenchConfig, chaos: ChaosConfig) -> dict:
    """Warm up, run the load of `cfg` with hostile requests mixed in at `chaos.rate`, wait for
    the server to go idle and check (module docstring). Returns JSON-ready results: those of
    `run_serve_bench` (the summary over the valid requests of the load) plus "chaos" (counts
    by kind and outcome, memory) and "checks".

    Raises:
        FileNotFoundError: prompt data missing.
        httpx.HTTPError: the server cannot be reached to find the model name.
    """
    return asyncio.run(_run(cfg, chaos))


async def _run(cfg: ServeBenchConfig, chaos: ChaosConfig) -> dict:
    prompts = prompt_texts(cfg)
    async with open_client(cfg) as client:
        model = cfg.model or await first_model(client, cfg.base_url)
        t0 = time.perf_counter()
        warmup = await send_burst(cfg, t0, cfg.concurrency + len(HOSTILE_KINDS),
                                  _warmup_sender(client, cfg, chaos, model, prompts, t0))
        before = await scrape(client, cfg.base_url)
        samples: list[dict] = [{"t_s": 0.0, **before}] if before else []
        scraper = asyncio.create_task(scrape_loop(client, cfg, samples))
        t0 = time.perf_counter()
        results = await send_all(cfg, t0, _sender(client, cfg, chaos, model, prompts, t0))
        wall_s = time.perf_counter() - t0
        scraper.cancel()
        after = await wait_idle(client, cfg.base_url, chaos.grace_s)
        if after is not None:
            samples.append({"t_s": time.perf_counter() - t0, **after})
    valid = [r for r in results if r.kind == "valid"]
    return {"config": public_config(cfg, model) | {"chaos": asdict(chaos)}, "wall_s": wall_s,
            "summary": summarize(valid, wall_s, cfg),
            "chaos": chaos_summary(results, warmup, before, after),
            "checks": [asdict(c) for c in run_checks(warmup + results, before, after)],
            "metrics_samples": samples, "requests": [asdict(r) for r in results]}


# ---------------------------------------------------------------- the load


def _sender(client: httpx.AsyncClient, cfg: ServeBenchConfig, chaos: ChaosConfig,
            model: str, prompts: list[str], t0: float):
    """send(i) for `send_all`: the i-th request of `plan_kinds`."""
    kinds = plan_kinds(chaos.rate, cfg.seed)

    def send(i: int):
        text, kind = prompts[i % len(prompts)], next(kinds)
        if kind == "valid":
            return send_valid(client, cfg, body_for(cfg, model, text), t0)
        return send_hostile(client, cfg, chaos, model, kind, text, t0)
    return send


def plan_kinds(rate: float, seed: int) -> Iterator[str]:
    """An endless sequence of request kinds: each is hostile with probability `rate` (a draw
    seeded by `seed`), the hostile ones taking HOSTILE_KINDS in turn; the others "valid"."""
    rng = random.Random(seed + 2)
    hostile = itertools.cycle(HOSTILE_KINDS)
    while True:
        yield next(hostile) if rng.random() < rate else "valid"


def _warmup_sender(client: httpx.AsyncClient, cfg: ServeBenchConfig, chaos: ChaosConfig,
                   model: str, prompts: list[str], t0: float):
    """send(i): `concurrency` valid requests (a full batch), then each hostile kind once."""
    def send(i: int):
        text = prompts[i % len(prompts)]
        if i < cfg.concurrency:
            return send_valid(client, cfg, body_for(cfg, model, text), t0)
        kind = HOSTILE_KINDS[i - cfg.concurrency]
        return send_hostile(client, cfg, chaos, model, kind, text, t0)
    return send


async def send_hostile(client: httpx.AsyncClient, cfg: ServeBenchConfig, chaos: ChaosConfig,
                       model: str, kind: str, text: str, t0: float) -> RequestResult:
    """One hostile request of `kind` (HOSTILE_KINDS) built around the prompt `text`; never
    raises (a connection failure is in the result's error, with status 0)."""
    start = time.perf_counter()
    result = RequestResult(start_s=start - t0, kind=kind)
    try:
        if kind == "disconnect":
            await _disconnect(client, cfg, chaos, body_for(cfg, model, text), result)
        elif kind == "cancel":
            await _cancel(client, cfg, chaos, _unstreamed(body_for(cfg, model, text)), result)
        else:
            url, content = bad_body(kind, cfg, model, text, chaos.max_request_bytes)
            resp = await client.post(url, content=content,
                                     headers={"Content-Type": "application/json"})
            result.status = resp.status_code
            result.error = None if resp.status_code == 200 else resp.text[:300]
    except (httpx.HTTPError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - start
    return result


def bad_body(kind: str, cfg: ServeBenchConfig, model: str, text: str,
             max_request_bytes: int) -> tuple[str, bytes]:
    """(url, body bytes) of the bad body `kind` (a key of EXPECTED_STATUS): a small valid
    non-streaming request with exactly one thing wrong.

    Raises:
        ValueError: `kind` is not a bad-body kind.
    """
    base = _unstreamed(body_for(cfg, model, text)) | {"max_tokens": 4}
    url = endpoint_url(cfg)
    if kind == "invalid_json":
        return url, json.dumps(base).encode()[:-1]  # the closing brace cut off
    if kind == "wrong_type":
        return url, json.dumps(base | {"temperature": True}).encode()
    if kind == "raw_nan":  # json.dumps writes a float NaN as the bare token NaN
        return url, json.dumps(base | {"temperature": math.nan}).encode()
    if kind == "lone_surrogate":  # json.dumps escapes it as \ud800, valid JSON, invalid text
        return url, json.dumps(_with_text(base, text + "\ud800")).encode()
    if kind == "unknown_field":
        return url, json.dumps(base | {"specmoe_chaos_unknown_field": 1}).encode()
    if kind == "oversize_body":
        return url, _padded(base, text, max_request_bytes + 1)
    if kind == "too_many_choices":
        body = {"model": model, "prompt": ["hi"] * 2000, "n": 16, "max_tokens": 1}
        return cfg.base_url + "/completions", json.dumps(body).encode()
    raise ValueError(f"invalid bad-body kind={kind!r}: choose from {sorted(EXPECTED_STATUS)}")


def _unstreamed(body: dict) -> dict:
    out = body | {"stream": False}
    out.pop("stream_options", None)  # only allowed with stream true
    return out


def _with_text(body: dict, text: str) -> dict:
    if "messages" in body:
        return body | {"messages": [{"role": "user", "content": text}]}
    return body | {"prompt": text}


def _padded(body: dict, text: str, num_bytes: int) -> bytes:
    """`body` with its text padded by spaces to exactly `num_bytes` bytes of JSON."""
    size = len(json.dumps(body).encode())
    return json.dumps(_with_text(body, text + " " * max(0, num_bytes - size))).encode()


async def _disconnect(client: httpx.AsyncClient, cfg: ServeBenchConfig, chaos: ChaosConfig,
                      body: dict, result: RequestResult) -> None:
    """Open a stream, read `disconnect_after_events` events and leave: closing a response
    before its end closes the connection, which the server sees as a disconnect."""
    async with client.stream("POST", endpoint_url(cfg), json=body) as resp:
        result.status = resp.status_code
        if resp.status_code != 200:
            result.error = (await resp.aread()).decode(errors="replace")[:300]
            return
        num_events = 0
        async for line in resp.aiter_lines():
            num_events += line.startswith("data:")
            if num_events >= chaos.disconnect_after_events:
                break


async def _cancel(client: httpx.AsyncClient, cfg: ServeBenchConfig, chaos: ChaosConfig,
                  body: dict, result: RequestResult) -> None:
    try:
        resp = await client.post(endpoint_url(cfg), json=body, timeout=chaos.cancel_after_s)
    except httpx.TimeoutException:  # the point: the client gave up and closed
        result.error = CANCELLED
        return
    result.status = resp.status_code


async def wait_idle(client: httpx.AsyncClient, base_url: str, grace_s: float) -> dict | None:
    """Scrape /metrics until it shows the server idle (`idle_problems`) or `grace_s`
    seconds pass; returns the last sample (None: no /metrics)."""
    deadline = time.perf_counter() + grace_s
    while True:
        sample = await scrape(client, base_url)
        if (sample is not None and not idle_problems(sample)) \
                or time.perf_counter() >= deadline:
            return sample
        await asyncio.sleep(IDLE_POLL_S)


# ---------------------------------------------------------------- checks (pure)


def outcome(r: RequestResult) -> str:
    """What one request got: its status ("200", "413", ...), "200+error_event" (an error
    mid-stream), "cancelled" (a cancel that timed out, as intended) or "no_response"."""
    if r.status == 0:
        return "cancelled" if r.error == CANCELLED else "no_response"
    if r.status == 200 and r.kind == "valid" and r.error is not None:
        return "200+error_event"
    return str(r.status)


def meets_expectation(r: RequestResult) -> bool:
    """Whether a bad body got its EXPECTED_STATUS (always True for other kinds)."""
    expected = EXPECTED_STATUS.get(r.kind)
    if expected == "4xx":
        return 400 <= r.status < 500
    return expected is None or str(r.status) == expected


def idle_problems(sample: dict) -> list[str]:
    """The IDLE_GAUGES of a /metrics `scrape` sample that are not 0, and the required ones
    missing (empty: idle)."""
    problems = [f"{name} missing" for name in REQUIRED_GAUGES if name not in sample]
    problems += [f"{name}={sample[name]:g}" for name in IDLE_GAUGES
                 if sample.get(name, 0) != 0]
    return problems


def rss_limit_bytes(before: float) -> float:
    """The largest resident-memory growth allowed over a run that started at `before` bytes."""
    return max(RSS_GROWTH_LIMIT_BYTES, RSS_GROWTH_LIMIT_FRACTION * before)


def run_checks(results: list[RequestResult], before: dict | None,
               after: dict | None) -> list[Check]:
    """The checks of a chaos run over every request (warm-up included), the /metrics sample
    taken after the warm-up (`before`) and the one taken once idle or at the end of the
    grace period (`after`; None: no /metrics, which fails the server-side checks)."""
    return [*request_checks(results), idle_check(after), memory_check(before, after)]


def request_checks(results: list[RequestResult]) -> list[Check]:
    """Every valid request succeeded; no hostile one got a 5xx; every bad body got its
    expected status."""
    valid = [r for r in results if r.kind == "valid"]
    hostile = [r for r in results if r.kind != "valid"]
    failed = [r for r in valid if not r.ok]
    server_errors = [r for r in hostile if r.status >= 500]
    unexpected = [r for r in hostile if not meets_expectation(r)]
    return [
        Check("no valid request failed", not failed,
              f"{len(failed)} of {len(valid)} failed" + _first(failed)),
        Check("no hostile request got a 5xx", not server_errors,
              f"{len(server_errors)} of {len(hostile)}" + _first(server_errors)),
        Check("every bad body got its 4xx", not unexpected,
              f"{len(unexpected)} unexpected" + _first(unexpected))]


def _first(results: list[RequestResult]) -> str:
    if not results:
        return ""
    r = results[0]
    return f"; first: {r.kind} -> {outcome(r)}: {(r.error or '')[:200]}"


def idle_check(after: dict | None) -> Check:
    name = "server idle after the load (no request running, waiting or in flight, no KV block)"
    if after is None:
        return Check(name, False, "no /metrics sample")
    problems = idle_problems(after)
    return Check(name, not problems, ", ".join(problems) or
                 ", ".join(f"{k}=0" for k in IDLE_GAUGES if k in after))


def memory_check(before: dict | None, after: dict | None) -> Check:
    name = "resident memory flat"
    key = "process_resident_memory_bytes"
    if not before or not after or key not in before or key not in after:
        return Check(name, False, f"{key} not sampled before and after the load")
    growth, limit = after[key] - before[key], rss_limit_bytes(before[key])
    return Check(name, growth <= limit,
                 f"{before[key] / 2**20:.0f} MiB after the warm-up, {after[key] / 2**20:.0f} "
                 f"MiB after the load: {growth / 2**20:+.1f} MiB (limit {limit / 2**20:.0f} MiB)")


def chaos_summary(results: list[RequestResult], warmup: list[RequestResult],
                  before: dict | None, after: dict | None) -> dict:
    """Counts of the load (warm-up apart): requests, valid and hostile, outcomes overall and
    by kind; resident memory before and after, in bytes."""
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        counts = by_kind.setdefault(r.kind, {})
        counts[outcome(r)] = counts.get(outcome(r), 0) + 1
    key = "process_resident_memory_bytes"
    return {"num_requests": len(results),
            "num_valid": sum(r.kind == "valid" for r in results),
            "num_hostile": sum(r.kind != "valid" for r in results),
            "num_warmup": len(warmup),
            "outcomes": dict(Counter(outcome(r) for r in results)),
            "by_kind": by_kind,
            "rss_before_bytes": (before or {}).get(key),
            "rss_after_bytes": (after or {}).get(key)}


def is_passed(results: dict) -> bool:
    """Whether every check of `run_chaos_bench` results passed."""
    return all(c["ok"] for c in results["checks"])


def render_chaos_markdown(results: dict) -> str:
    """The `render_markdown` report of the valid traffic, then the hostile side and the
    checks."""
    c, cfg = results["chaos"], results["config"]["chaos"]
    lines = ["", f"## Chaos (rate {cfg['rate']:g})", "",
             f"{c['num_requests']} requests sent: {c['num_valid']} valid, {c['num_hostile']} "
             f"hostile (plus {c['num_warmup']} warm-up requests, checked too). "
             f"Outcomes: {c['outcomes']}.", "",
             "| kind | sent | outcomes | expected |", "|---|---:|---|---|"]
    for kind in ("valid", *HOSTILE_KINDS):
        if kind in c["by_kind"]:
            counts = c["by_kind"][kind]
            expected = "200" if kind == "valid" else EXPECTED_STATUS.get(kind, "no 5xx")
            lines.append(f"| {kind} | {sum(counts.values())} | {counts} | {expected} |")
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {ch['name']} | {'PASS' if ch['ok'] else 'FAIL'} | {ch['detail']} |"
              for ch in results["checks"]]
    return render_markdown(results) + "\n".join(lines) + "\n"
