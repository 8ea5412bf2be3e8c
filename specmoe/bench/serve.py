"""`specmoe bench serve`: an async HTTP load generator for any OpenAI-compatible server.

It replays real prompts (Spec-Bench, MT-Bench first turns; `specmoe.utils.data`) as streaming
chat or completion requests, at a fixed request rate (Poisson arrivals) or as fast as the
concurrency cap allows, for a number of requests or a duration, and measures per request the
time to first token (TTFT), time per output token after the first (TPOT), end-to-end latency
and the HTTP status. The report gives throughput (requests/s, output tokens/s), P50/P95/P99
of each latency, error counts by status, and goodput: requests/s that succeeded within both
SLOs (TTFT <= slo_ttft_s and TPOT <= slo_tpot_s), as vLLM's benchmark_serving defines it.

When the server exposes Prometheus metrics at <base>/metrics (ours does), they are sampled
during the run: resident memory, KV cache blocks used, requests running and waiting; the
last sample is taken after the load has ended, so a soak run shows whether every KV block
came back and whether memory stayed steady. `specmoe.bench.chaos` builds a soak on this load
generator that mixes hostile clients into the valid traffic and checks that they hurt nobody.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np

from specmoe.utils.data import load_prompts

SCRAPED = ("process_resident_memory_bytes", "specmoe:kv_cache_blocks_used",
           "specmoe:kv_cache_usage_perc", "specmoe:num_requests_running",
           "specmoe:num_requests_waiting", "specmoe:num_requests_in_flight")


@dataclass
class ServeBenchConfig:
    """Options of `specmoe bench serve`.

    Attributes:
        base_url: the API root, e.g. http://127.0.0.1:8000/v1.
        model: the model name to send (None: the first of GET /v1/models).
        api_key: bearer token, if the server needs one.
        endpoint: "chat" (/chat/completions) or "completions" (/completions, raw prompt).
        datasets: prompt sets to cycle through ("spec_bench", "mt_bench", ...).
        num_requests: requests to send (ignored when duration_s is set).
        duration_s: send requests for this many seconds instead (a soak run).
        request_rate: mean requests per second (Poisson arrivals); inf sends as fast as the
            concurrency cap allows.
        concurrency: requests in flight at most.
        max_tokens: max_tokens of every request.
        temperature: sampling temperature (0: greedy).
        ignore_eos: send the `ignore_eos` extension (our server and vLLM) so every request
            generates max_tokens tokens.
        slo_ttft_s, slo_tpot_s: goodput thresholds, in seconds.
        timeout_s: per-request timeout, in seconds.
        metrics_interval_s: seconds between /metrics samples.
        seed: shuffles the prompts and draws the arrival times.
    """

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "chat"
    datasets: list[str] = field(default_factory=lambda: ["spec_bench", "mt_bench"])
    num_requests: int = 100
    duration_s: float | None = None
    request_rate: float = float("inf")
    concurrency: int = 16
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    timeout_s: float = 600.0
    metrics_interval_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"invalid endpoint={self.endpoint!r}: must be chat or completions")
        if self.concurrency < 1:
            raise ValueError(f"invalid concurrency={self.concurrency}: must be >= 1")
        if self.request_rate <= 0:
            raise ValueError(f"invalid request_rate={self.request_rate}: must be > 0 (inf: "
                             "as fast as the concurrency allows)")
        if self.duration_s is None and self.num_requests < 1:
            raise ValueError(f"invalid num_requests={self.num_requests}: must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"invalid duration_s={self.duration_s}: must be > 0")


@dataclass(slots=True)
class RequestResult:
    """One request: seconds since the run started / since it was sent.

    Attributes:
        status: HTTP status (0: no response, e.g. connection refused or timeout).
        error: the error text, if any (an HTTP error body or an error event mid-stream).
        kind: "valid", or the hostile action of a chaos run (`specmoe.bench.chaos`).
    """

    start_s: float
    kind: str = "valid"
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    """Run the load and return JSON-ready results (config, summary, requests, metrics).

    Raises:
        FileNotFoundError: prompt data missing.
        httpx.HTTPError: the server cannot be reached to find the model name.
    """
    return asyncio.run(_run(cfg))


async def _run(cfg: ServeBenchConfig) -> dict:
    prompts = prompt_texts(cfg)
    async with open_client(cfg) as client:
        model = cfg.model or await first_model(client, cfg.base_url)
        samples: list[dict] = []
        scraper = asyncio.create_task(scrape_loop(client, cfg, samples))
        t0 = time.perf_counter()
        results = await send_all(cfg, t0, lambda i: send_valid(
            client, cfg, body_for(cfg, model, prompts[i % len(prompts)]), t0))
        wall_s = time.perf_counter() - t0
        scraper.cancel()
        await asyncio.sleep(1.0)  # let the server publish its state after the last request
        final = await scrape(client, cfg.base_url)
        if final is not None:
            samples.append({"t_s": time.perf_counter() - t0, **final})
    return {"config": public_config(cfg, model), "wall_s": wall_s,
            "summary": summarize(results, wall_s, cfg),
            "metrics_samples": samples, "requests": [asdict(r) for r in results]}


def open_client(cfg: ServeBenchConfig) -> httpx.AsyncClient:
    """A client with the bearer token, `timeout_s` per request and a connection for every
    request in flight."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 2)
    return httpx.AsyncClient(headers=headers, limits=limits,
                             timeout=httpx.Timeout(cfg.timeout_s, connect=30.0))


def public_config(cfg: ServeBenchConfig, model: str) -> dict:
    """`cfg` as JSON, with the model used; the API key itself is never written."""
    return asdict(cfg) | {"model": model, "api_key": "<set>" if cfg.api_key else None}


def prompt_texts(cfg: ServeBenchConfig) -> list[str]:
    """The prompts of `cfg.datasets`, shuffled by `cfg.seed`.

    Raises:
        FileNotFoundError: prompt data missing.
    """
    texts = [p.text for d in cfg.datasets for p in load_prompts(d)]
    random.Random(cfg.seed).shuffle(texts)
    return texts


async def send_all(cfg: ServeBenchConfig, t0: float,
                   send: Callable[[int], Awaitable[RequestResult]]) -> list[RequestResult]:
    """Await `send(i)` for i = 0, 1, ... at the configured rate, at most `concurrency` in
    flight, until num_requests were sent or duration_s seconds passed since `t0` (a
    perf_counter time); wait for them all. Returns their results in sending order."""
    rng = random.Random(cfg.seed + 1)
    slots = asyncio.Semaphore(cfg.concurrency)
    tasks: list[asyncio.Task] = []
    next_send = 0.0
    for i in itertools.count():
        if cfg.duration_s is None and i >= cfg.num_requests:
            break
        if cfg.duration_s is not None and time.perf_counter() - t0 >= cfg.duration_s:
            break
        if cfg.request_rate != float("inf"):
            next_send += rng.expovariate(cfg.request_rate)
            await asyncio.sleep(max(0.0, t0 + next_send - time.perf_counter()))
        await slots.acquire()
        tasks.append(asyncio.create_task(_release_after(send(i), slots)))
    return list(await asyncio.gather(*tasks))


async def send_burst(cfg: ServeBenchConfig, t0: float, num_requests: int,
                     send: Callable[[int], Awaitable[RequestResult]]) -> list[RequestResult]:
    """`send_all` for exactly `num_requests`, as fast as the concurrency cap allows (a
    warm-up)."""
    burst = replace(cfg, num_requests=num_requests, duration_s=None,
                    request_rate=float("inf"))
    return await send_all(burst, t0, send)


async def _release_after(request: Awaitable[RequestResult],
                         slots: asyncio.Semaphore) -> RequestResult:
    try:
        return await request
    finally:
        slots.release()


def body_for(cfg: ServeBenchConfig, model: str, text: str) -> dict:
    """The JSON body of a valid streaming request for `text` (chat message or raw prompt)."""
    body = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def endpoint_url(cfg: ServeBenchConfig) -> str:
    return cfg.base_url + ("/chat/completions" if cfg.endpoint == "chat" else "/completions")


async def send_valid(client: httpx.AsyncClient, cfg: ServeBenchConfig, body: dict,
                     t0: float) -> RequestResult:
    """Send one streaming request and read it to the end; never raises (a failure is in
    the result's status and error)."""
    start = time.perf_counter()
    result = RequestResult(start_s=start - t0)
    try:
        async with client.stream("POST", endpoint_url(cfg), json=body) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                result.error = (await resp.aread()).decode(errors="replace")[:500]
                return result
            await _read_events(resp, result, start)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if result.e2e_s is None and result.error is None:
            result.e2e_s = time.perf_counter() - start
    return result


async def _read_events(resp: httpx.Response, result: RequestResult, start: float) -> None:
    """Parse server-sent events: time the first content, count tokens (usage when sent,
    else content chunks), note an error event."""
    num_chunks, usage_tokens = 0, None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            result.error = str(event["error"].get("message"))
            continue
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
        choices = event.get("choices") or []
        if any(_content(c) for c in choices):
            num_chunks += 1
        # The first token arrives with the first text, or with the finish of a request
        # whose tokens decode to no text (an immediate end-of-sequence token).
        if result.ttft_s is None and any(_content(c) or c.get("finish_reason")
                                         for c in choices):
            result.ttft_s = time.perf_counter() - start
    result.e2e_s = time.perf_counter() - start
    result.num_output_tokens = usage_tokens if usage_tokens is not None else num_chunks


def _content(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The id of the first model of GET <base_url>/models.

    Raises:
        httpx.HTTPStatusError: the server answered with an error status.
    """
    resp = await client.get(base_url + "/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def scrape_loop(client: httpx.AsyncClient, cfg: ServeBenchConfig,
                      samples: list[dict]) -> None:
    """Append a `scrape` sample to `samples` every metrics_interval_s seconds, until
    cancelled."""
    t0 = time.perf_counter()
    while True:
        sample = await scrape(client, cfg.base_url)
        if sample is not None:
            samples.append({"t_s": time.perf_counter() - t0, **sample})
        await asyncio.sleep(cfg.metrics_interval_s)


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict | None:
    """The SCRAPED gauges and the HTTP status counts from <root>/metrics; None if absent."""
    from prometheus_client.parser import text_string_to_metric_families
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        resp = await client.get(root + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    out: dict = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            if s.name in SCRAPED:
                out[s.name] = out.get(s.name, 0.0) + s.value
            elif s.name == "specmoe:http_responses_total":
                out.setdefault("http_responses", {})[s.labels["status"]] = s.value
    return out


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None}
    a = np.asarray(values)
    return {"n": len(values), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p95": float(np.percentile(a, 95)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], wall_s: float, cfg: ServeBenchConfig) -> dict:
    """Throughput, latency percentiles (s), errors by status and goodput of a run."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = str(r.status) if r.status else "no_response"
            errors[key] = errors.get(key, 0) + 1
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= cfg.slo_ttft_s
            and (r.tpot_s is None or r.tpot_s <= cfg.slo_tpot_s)]
    num_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "num_requests": len(results), "num_ok": len(ok), "errors": errors,
        "num_5xx": sum(n for k, n in errors.items() if k.startswith("5")),
        "wall_s": wall_s, "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": num_tokens / wall_s if wall_s else 0.0,
        "num_output_tokens": num_tokens,
        "goodput_requests_per_s": len(good) / wall_s if wall_s else 0.0,
        "num_good": len(good),
        "ttft_s": _percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": _percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


def render_markdown(results: dict) -> str:
    """A short Markdown report of `run_serve_bench` results."""
    cfg, s = results["config"], results["summary"]
    load = (f"{cfg['duration_s']:.0f} s" if cfg["duration_s"] else f"{cfg['num_requests']} "
            "requests")
    lines = [
        "# specmoe bench serve", "",
        f"{cfg['base_url']} · model `{cfg['model']}` · {cfg['endpoint']} · {load} · "
        f"rate {cfg['request_rate']} req/s · concurrency {cfg['concurrency']} · "
        f"max_tokens {cfg['max_tokens']} · temperature {cfg['temperature']}", "",
        "| requests | ok | errors | 5xx | wall (s) | req/s | output tok/s | goodput (req/s) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
        f"| {s['num_requests']} | {s['num_ok']} | {s['errors'] or '-'} | {s['num_5xx']} | "
        f"{s['wall_s']:.1f} | {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} | "
        f"{s['goodput_requests_per_s']:.2f} |", "",
        f"Goodput SLOs: TTFT <= {cfg['slo_ttft_s']} s, TPOT <= {cfg['slo_tpot_s']} s.", "",
        "| latency (s) | requests | mean | P50 | P95 | P99 |", "|---|---:|---:|---:|---:|---:|"]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end to end")):
        p = s[key]
        cells = " | ".join("-" if p[q] is None else f"{p[q]:.3f}"
                           for q in ("mean", "p50", "p95", "p99"))
        lines.append(f"| {name} | {p['n']} | {cells} |")
    lines += _metrics_lines(results["metrics_samples"])
    return "\n".join(lines) + "\n"


def _metrics_lines(samples: list[dict]) -> list[str]:
    if not samples:
        return ["", "No /metrics endpoint: server-side state not sampled."]
    rss = [x["process_resident_memory_bytes"] / 2**20 for x in samples
           if "process_resident_memory_bytes" in x]
    last = samples[-1]
    lines = ["", f"Server (/metrics, {len(samples)} samples; the last after the load ended):"]
    if rss:
        lines.append(f"- resident memory: first {rss[0]:.0f} MiB, max {max(rss):.0f} MiB, "
                     f"last {rss[-1]:.0f} MiB")
    for name in SCRAPED[1:]:
        if name in last:
            lines.append(f"- {name} at the end: {last[name]:g}")
    if "http_responses" in last:
        lines.append("- HTTP responses by status since the server started: "
                     f"{last['http_responses']}")
    return lines


def write_report(results: dict, out: Path, markdown: str | None = None) -> list[Path]:
    """Write results.json and report.md (`markdown`, default `render_markdown(results)`)
    into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(results, indent=1))
    paths[1].write_text(render_markdown(results) if markdown is None else markdown)
    return paths
