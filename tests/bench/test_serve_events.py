"""`bench serve` reads server-sent events: time to first token and token counts."""

from __future__ import annotations

import asyncio
import json

from specmoe.bench.serve import RequestResult, _percentiles, _read_events


class FakeResponse:
    """The part of httpx.Response that `_read_events` uses."""

    def __init__(self, events: list[dict]) -> None:
        self.lines = [f"data: {json.dumps(e)}" for e in events] + ["", "data: [DONE]"]

    async def aiter_lines(self):
        for line in self.lines:
            yield line


def _read(events: list[dict]) -> RequestResult:
    result = RequestResult(start_s=0.0, status=200)
    asyncio.run(_read_events(FakeResponse(events), result, start=0.0))
    return result


def test_text_chunks_and_usage():
    r = _read([{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
               {"choices": [], "usage": {"completion_tokens": 3}}])
    assert r.ttft_s is not None and r.num_output_tokens == 3 and r.ok


def test_first_token_without_text_still_has_a_ttft():
    """A request whose only token is the end of sequence streams no text, just a finish."""
    r = _read([{"choices": [{"text": "", "finish_reason": "stop"}]}])
    assert r.ttft_s is not None and r.tpot_s is None


def test_error_event_fails_the_request():
    r = _read([{"choices": [{"text": "a"}]}, {"error": {"message": "engine step failed"}}])
    assert not r.ok and r.error == "engine step failed"


def test_percentiles_count_their_samples():
    assert _percentiles([])["n"] == 0
    p = _percentiles([1.0, 2.0, 3.0])
    assert p["n"] == 3 and p["p50"] == 2.0
