"""`specmoe bench serve --chaos`: the hostile requests it builds, the checks (which must fail on
a failed valid request, a 5xx, a server left busy or memory that grew), and a short chaos run
against a live `specmoe serve` of the bundled tiny-moe."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from specmoe.bench.chaos import (EXPECTED_STATUS, HOSTILE_KINDS, ChaosConfig,
                                 bad_body, idle_check, is_passed, memory_check, plan_kinds,
                                 render_chaos_markdown, request_checks, rss_limit_bytes,
                                 run_checks)
from specmoe.bench.serve import RequestResult, ServeBenchConfig
from specmoe.entrypoints.cli import main

MIB = 2**20
IDLE = {"specmoe:num_requests_running": 0.0, "specmoe:num_requests_waiting": 0.0,
        "specmoe:num_requests_in_flight": 0.0, "specmoe:kv_cache_blocks_used": 0.0,
        "specmoe:kv_cache_usage_perc": 0.0, "process_resident_memory_bytes": 500.0 * MIB}


# ---- the hostile requests ------------------------------------------------------------------


@pytest.mark.parametrize("rate", [-0.1, 1.5, math.nan])
def test_rate_outside_0_1_is_refused(rate):
    with pytest.raises(ValueError, match="chaos rate"):
        ChaosConfig(rate=rate)


def test_plan_mixes_hostile_requests_at_the_rate_and_takes_kinds_in_turn():
    plan = list(itertools.islice(plan_kinds(0.3, seed=0), 3000))
    hostile = [k for k in plan if k != "valid"]
    assert 0.27 < len(hostile) / len(plan) < 0.33
    assert hostile[:2 * len(HOSTILE_KINDS)] == list(HOSTILE_KINDS) * 2
    assert plan == list(itertools.islice(plan_kinds(0.3, seed=0), 3000))  # seeded
    assert set(itertools.islice(plan_kinds(0.0, seed=0), 500)) == {"valid"}
    assert "valid" not in set(itertools.islice(plan_kinds(1.0, seed=0), 500))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_each_bad_body_has_exactly_its_flaw(endpoint):
    cfg = ServeBenchConfig(base_url="http://h/v1", endpoint=endpoint)
    bodies = {kind: bad_body(kind, cfg, "m", "Hello", 1000) for kind in EXPECTED_STATUS}
    with pytest.raises(json.JSONDecodeError):
        json.loads(bodies["invalid_json"][1])
    assert json.loads(bodies["wrong_type"][1])["temperature"] is True
    assert b'"temperature": NaN' in bodies["raw_nan"][1]
    assert b"\\ud800" in bodies["lone_surrogate"][1]
    assert "specmoe_chaos_unknown_field" in json.loads(bodies["unknown_field"][1])
    assert len(bodies["oversize_body"][1]) == 1001
    many = json.loads(bodies["too_many_choices"][1])
    assert bodies["too_many_choices"][0] == "http://h/v1/completions"
    assert len(many["prompt"]) * many["n"] > 256  # the server's per-request cap
    # apart from its flaw, each is a small non-streaming request to the run's endpoint
    ok = json.loads(bodies["unknown_field"][1])
    assert ok["stream"] is False and ok["max_tokens"] == 4 and "stream_options" not in ok
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    assert bodies["wrong_type"][0] == "http://h/v1" + path
    with pytest.raises(ValueError, match="bad-body kind"):
        bad_body("disconnect", cfg, "m", "Hello", 1000)


# ---- the checks can fail -------------------------------------------------------------------


def _r(kind="valid", status=200, error=None) -> RequestResult:
    return RequestResult(start_s=0.0, kind=kind, status=status, error=error, e2e_s=0.1)


GOOD = [_r(), _r(), _r("invalid_json", 400), _r("oversize_body", 413),
        _r("disconnect", 200), _r("cancel", 0, "cancelled by the client")]


def _failed(checks) -> list[str]:
    return [c.name for c in checks if not c.ok]


def test_a_clean_run_passes_every_check():
    after = IDLE | {"process_resident_memory_bytes": IDLE["process_resident_memory_bytes"]
                    + 10 * MIB}
    assert _failed(run_checks(GOOD, IDLE, after)) == []


@pytest.mark.parametrize("bad, failing", [
    (_r(status=500, error="boom"), "no valid request failed"),
    (_r(status=429, error="queue full"), "no valid request failed"),
    (_r(status=200, error="engine step failed"), "no valid request failed"),  # error event
    (_r(status=0, error="ReadTimeout"), "no valid request failed"),
    (_r("disconnect", 503), "no hostile request got a 5xx"),
    (_r("lone_surrogate", 500), "no hostile request got a 5xx"),
])
def test_a_failed_valid_request_or_a_5xx_fails(bad, failing):
    failed = _failed(request_checks(GOOD + [bad]))
    assert failing in failed


@pytest.mark.parametrize("kind, status", [("wrong_type", 200), ("oversize_body", 400),
                                          ("raw_nan", 0), ("unknown_field", 500)])
def test_a_bad_body_without_its_expected_status_fails(kind, status):
    assert "every bad body got its 4xx" in _failed(request_checks(GOOD + [_r(kind, status)]))


@pytest.mark.parametrize("change", [{"specmoe:num_requests_running": 1.0},
                                   {"specmoe:num_requests_waiting": 2.0},
                                   {"specmoe:num_requests_in_flight": 1.0},
                                   {"specmoe:kv_cache_blocks_used": 3.0},
                                   {"specmoe:kv_cache_usage_perc": 0.01}])
def test_a_busy_final_scrape_fails(change):
    check = idle_check(IDLE | change)
    assert not check.ok and next(iter(change)) in check.detail


def test_no_scrape_or_missing_gauges_fail():
    assert not idle_check(None).ok
    partial = {k: v for k, v in IDLE.items() if k != "specmoe:num_requests_running"}
    assert not idle_check(partial).ok
    assert not memory_check(IDLE, None).ok


def test_memory_growth_over_the_limit_fails():
    before = IDLE["process_resident_memory_bytes"]
    assert rss_limit_bytes(before) == 64 * MIB  # 10% of 500 MiB is less than the floor
    assert rss_limit_bytes(2000 * MIB) == pytest.approx(200 * MIB)
    grown = lambda d: IDLE | {"process_resident_memory_bytes": before + d}  # noqa: E731
    assert memory_check(IDLE, grown(64 * MIB)).ok
    check = memory_check(IDLE, grown(65 * MIB))
    assert not check.ok and "+65.0 MiB" in check.detail


def test_report_names_the_failed_check():
    checks = run_checks(GOOD + [_r(status=500, error="boom")], IDLE, IDLE)
    results = {"config": {"base_url": "u", "model": "m", "endpoint": "completions",
                          "duration_s": None, "num_requests": 7, "request_rate": "inf",
                          "concurrency": 2, "max_tokens": 4, "temperature": 0.0,
                          "slo_ttft_s": 2.0, "slo_tpot_s": 0.25, "chaos": {"rate": 0.5}},
               "summary": _summary(), "metrics_samples": [],
               "chaos": {"num_requests": 7, "num_valid": 3, "num_hostile": 4, "num_warmup": 0,
                         "outcomes": {"200": 3}, "by_kind": {"valid": {"200": 2, "500": 1}}},
               "checks": [c.__dict__ for c in checks]}
    assert not is_passed(results)
    assert "| no valid request failed | FAIL | 1 of 3 failed" in render_chaos_markdown(results)


def _summary() -> dict:
    p = {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None}
    return {"num_requests": 3, "num_ok": 2, "errors": {"500": 1}, "num_5xx": 1, "wall_s": 1.0,
            "requests_per_s": 2.0, "output_tokens_per_s": 8.0, "goodput_requests_per_s": 2.0,
            "ttft_s": p, "tpot_s": p, "e2e_s": p}


# ---- a live server -------------------------------------------------------------------------


LIMIT = 65536  # the server's --max-request-bytes: a small oversize body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_server():
    """`specmoe serve` of the bundled tiny-moe (the cheapest model) on a free loopback
    port."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "specmoe.entrypoints.cli", "serve", "--model", "tiny-moe",
           "--port", str(port), "--threads", "1", "--max-request-bytes", str(LIMIT),
           "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SPECMOE_API_KEY", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"server not ready (exit {proc.poll()})")
        yield url
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.slow
def test_chaos_run_against_a_live_server_passes_every_check(tiny_server, tmp_path):
    """48 requests at concurrency 8, 30% hostile (GSM8K prompts fit tiny-moe's 512 tokens):
    the run exits 0, every check passed, every bad body got its 4xx, the server lives on."""
    rc = main(["bench", "serve", "--base-url", tiny_server + "/v1", "--endpoint",
               "completions", "--datasets", "gsm8k", "--num-requests", "48",
               "--concurrency", "8", "--max-tokens", "16", "--chaos", "0.3",
               "--chaos-cancel-after", "0.05", "--chaos-max-request-bytes", str(LIMIT),
               "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, [c for c in results["checks"] if not c["ok"]]
    assert all(c["ok"] for c in results["checks"]) and len(results["checks"]) == 5
    chaos = results["chaos"]
    assert chaos["num_requests"] == 48 and chaos["num_hostile"] > 0
    assert chaos["num_valid"] + chaos["num_hostile"] == 48
    assert chaos["by_kind"]["valid"] == {"200": chaos["num_valid"]}
    for r in results["requests"]:
        if r["kind"] in EXPECTED_STATUS:
            assert 400 <= r["status"] < 500, r
        if r["kind"] == "oversize_body":
            assert r["status"] == 413
    assert results["summary"]["e2e_s"]["n"] == chaos["num_valid"]
    assert chaos["rss_before_bytes"] > 0 and chaos["rss_after_bytes"] > 0
    assert "## Chaos (rate 0.3)" in (tmp_path / "report.md").read_text()
    assert httpx.get(tiny_server + "/health", timeout=5).status_code == 200
