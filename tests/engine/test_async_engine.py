"""AsyncEngine: streaming deltas, UTF-8 and stop-string safety, failure isolation, queue bound.

Streaming mechanics run on a scripted engine (fixed token ids, one per step) with the real
SmolLM2 tokenizer, so multi-byte characters split across tokens are certain; failure
isolation and the final-output path run on the real engine.
"""

from __future__ import annotations

import asyncio

import pytest

from specmoe import LLM, SamplingParams
from specmoe.engine.async_engine import (AsyncEngine, QueueFullError, RequestFailedError,
                                         safe_stream_text)
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
    assert safe_stream_text("hello wo", ["world"]) == "hell"
    assert safe_stream_text("hello", ["x"]) == "hello"


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
