"""AsyncEngine: streaming deltas, UTF-8 and stop-string safety, failure isolation, queue bound.

Streaming mechanics run on a scripted engine (fixed token ids, one per step) with the real
SmolLM2 tokenizer, so multi-byte characters split across tokens are certain; failure
isolation and the final-output path run on the real engine.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from specmoe import LLM, SamplingParams
from specmoe.engine.async_engine import AsyncEngine, QueueFullError, RequestFailedError
from specmoe.engine.detokenizer import safe_stream_text
from specmoe.engine.block_pool import PrefixCacheStats
from specmoe.engine.output_processor import OutputProcessor
from specmoe.engine.stats import EngineStats
from specmoe.outputs import RequestOutput
from specmoe.request import Request

TEXT = "héllo 😀 wörld ✓ done"


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:
    return LLM(smollm2, dtype="float32", max_model_len=256, scheduler={"max_num_seqs": 4})


class _Pool:
    num_used_blocks, num_blocks = 0, 16
    prefix_cache_stats = PrefixCacheStats()


class _Scheduler:
    def __init__(self) -> None:
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.config = type("C", (), {"max_num_seqs": 1})()
        self.kv_cache = type("K", (), {"block_pool": _Pool()})()


class _ScriptedEngine:
    def __init__(self) -> None:
        self.scheduler = _Scheduler()
        self.stats = EngineStats()

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.running = [r for r in self.scheduler.running
                                  if r.request_id != request_id]


class ScriptedLLM:
    """Each request emits `script` one token per step through the real OutputProcessor."""

    def __init__(self, tokenizer, script: list[int]) -> None:
        self.processor = OutputProcessor(tokenizer, set(), 10_000)
        self.engine = _ScriptedEngine()
        self.target = SimpleNamespace(failure=None)  # a working target, as ModelRunner's
        self.script = script

    def add_request(self, req: Request) -> None:
        self.engine.scheduler.running.append(req)

    def step(self) -> list[RequestOutput]:
        finished = []
        for req in list(self.engine.scheduler.running):
            self.processor.append(req, [self.script[len(req.output_token_ids)]])
            if len(req.output_token_ids) == len(self.script) and not req.is_finished:
                req.finish_reason = "length"
                self.processor._finalize_text(req)
            if req.is_finished:
                self.engine.scheduler.running.remove(req)
                finished.append(RequestOutput(req.request_id, None, req.prompt_token_ids,
                                              req.text, req.output_token_ids, None,
                                              req.finish_reason, req.stop_reason,
                                              req.spec_stats, req.metrics))
        return finished


async def _stream(engine: AsyncEngine, req: Request) -> tuple[list[str], str]:
    engine.start()
    pieces, final = [], None
    async for delta in engine.submit([req], is_streaming=True)[0]:
        pieces.append(delta.text)
        if delta.output is not None:
            final = delta.output.text
    await engine.shutdown(1.0)
    return pieces, final


@pytest.mark.parametrize("stop", [[], ["wör"]], ids=["no-stop", "stop"])
def test_stream_never_splits_utf8_or_leaks_stop(llm, stop):
    ids = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    partial = [llm.tokenizer.decode(ids[:i]) for i in range(1, len(ids))]
    assert any(p.endswith("\ufffd") for p in partial)  # the script splits a character
    fake = ScriptedLLM(llm.tokenizer, ids)
    req = Request("r", "p", [1], SamplingParams(max_tokens=len(ids), stop=stop))
    pieces, final = asyncio.run(_stream(AsyncEngine(fake), req))
    assert final == (TEXT.split("wör")[0] if stop else TEXT)
    assert "".join(pieces) == final
    assert all("\ufffd" not in p for p in pieces)
    assert len([p for p in pieces if p]) > 3  # really incremental


def test_safe_stream_text():
    assert safe_stream_text("ab\ufffd", []) == "ab"
    assert safe_stream_text("hello wo", ["world"]) == "hello "
    assert safe_stream_text("hello", ["x"]) == "hello"
    # D3: text shorter than the longest stop string (a negative slice showed ' h', ' the Unite')
    assert safe_stream_text(" ha", ["ha ha"]) == " "
    assert safe_stream_text(" the Unite", ["United States"]) == " the "
    assert safe_stream_text(" the Uni", ["x", "United States"]) == " the "
    assert safe_stream_text("abc", ["United States"]) == "abc"


@pytest.mark.parametrize("text,stop", [(" ha ha, and more", "ha ha"),
                                       (" the United States is", "United States")])
def test_stream_never_shows_what_the_stop_string_cuts(llm, text, stop):
    """D3 end to end: one token per step, every streamed piece is a prefix of the final text
    (which ends before the stop string)."""
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    fake = ScriptedLLM(llm.tokenizer, ids)
    req = Request("r", "p", [1], SamplingParams(max_tokens=len(ids), stop=[stop]))
    pieces, final = asyncio.run(_stream(AsyncEngine(fake), req))
    assert final == text.split(stop)[0]
    assert "".join(pieces) == final


def test_failed_step_fails_its_requests_and_engine_goes_on(llm, monkeypatch):
    real_step = llm.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(llm, "step", flaky_step)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run() -> str:
        engine = AsyncEngine(llm)
        engine.start()
        bad = engine.submit([llm.make_request("Hello", params)], is_streaming=True)[0]
        with pytest.raises(RequestFailedError, match="boom"):
            async for _ in bad:
                pass
        good = engine.submit([llm.make_request("Hello", params)], is_streaming=False)[0]
        deltas = [d async for d in good]
        await engine.shutdown(1.0)
        return deltas[-1].output

    out = asyncio.run(run())
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert llm.engine.scheduler.kv_cache.block_pool.num_used_blocks == 0


def test_queue_full_and_abort_frees_blocks(llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run() -> None:
        engine = AsyncEngine(llm, max_waiting=1)
        engine.start()
        streams = engine.submit([llm.make_request("Hi", params) for _ in range(5)], True)
        with pytest.raises(QueueFullError):  # 5 > 4 free slots: one waits, the queue is full
            engine.submit([llm.make_request("Hi", params)], True)
        await anext(aiter(streams[0]))
        for s in streams:
            s.abort()
        assert await engine.wait_idle(60)
        await engine.shutdown(1.0)

    asyncio.run(run())
    assert llm.engine.scheduler.kv_cache.block_pool.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests


def test_admission_counts_engine_requests(llm):
    """D5: an HTTP request's prompts x n count against max_waiting, not as one; a batch larger
    than max_waiting is still admitted when nothing waits (it would never be otherwise)."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run() -> None:
        engine = AsyncEngine(llm, max_waiting=4)
        engine.start()
        make = lambda k: [llm.make_request("Hi", params) for _ in range(k)]  # noqa: E731
        streams = engine.submit(make(10), True)  # idle: admitted whole (4 run, 6 wait)
        await anext(aiter(streams[0]))
        with pytest.raises(QueueFullError, match="6 requests wait"):
            engine.submit(make(1), True)
        for s in streams[:3]:
            s.abort()  # 3 fewer waiting: 3 wait beyond the free slots
        while engine._inbox.num_waiting - engine._inbox.num_free_seqs > 3:
            await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError):
            engine.submit(make(2), True)  # 3 + 2 > 4
        streams += engine.submit(make(1), True)  # 3 + 1 <= 4
        for s in streams:
            s.abort()
        assert await engine.wait_idle(60)
        await engine.shutdown(1.0)

    asyncio.run(run())
    assert llm.engine.scheduler.kv_cache.block_pool.num_used_blocks == 0


def test_abort_returns_what_was_generated(llm):
    """An aborted non-streaming request (drain timeout, abort_all) still gets its partial
    output, finish_reason "abort", like the streaming one beside it."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run():
        engine = AsyncEngine(llm)
        engine.start()
        quiet = engine.submit([llm.make_request("Once upon a time", params)], False)[0]
        streaming = engine.submit([llm.make_request("Once upon a time", params)], True)[0]
        for _ in range(3):
            await anext(aiter(streaming))
        engine.abort_all()
        deltas = [d async for d in quiet]
        await engine.shutdown(1.0)
        return deltas

    deltas = asyncio.run(run())
    assert len(deltas) == 1 and deltas[0].finish_reason == "abort"
    assert len(deltas[0].token_ids) >= 3
    assert deltas[0].text == llm.processor.decode(deltas[0].token_ids) and deltas[0].text.strip()
