"""One request that makes a step fail fails alone (issue 23, "isolation by construction").

A busy batch (greedy and seeded sampled requests, n-gram speculation on) runs once clean and
once with poisoned requests mixed in: one whose prompt makes the target forward raise, one
whose context makes the proposer raise, and one whose verification raises after it (and its
neighbours) drew their random numbers. Every neighbour's output must equal the clean run's,
token for token; the poisoned ones end with finish_reason "error"; the KV cache gets every
block back. Over a tiny random Llama in float32 (no real model: fast, and the failures are
forced by wrapping the real calls).
"""

from __future__ import annotations

import asyncio

import pytest

from specmoe import LLM, SamplingParams
from specmoe.engine import core
from specmoe.engine.async_engine import AsyncEngine, RequestFailedError
from specmoe.engine.isolation import run_isolated
from tiny_models import save_tiny_llama

FORWARD_POISON = 499  # a prompt holding this token makes the target forward raise
PROPOSE_POISON = 498  # ... makes the proposer raise
VERIFY_POISON_SEED = 4242  # a request with this seed makes verification raise


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    """A random 2-layer Llama (vocabulary 512, context 256) with n-gram speculation (K=3)."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_isolation"), hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2,
                           max_position_embeddings=256)
    plain = LLM(str(path), dtype="float32", scheduler={"max_num_seqs": 16, "block_size": 16})
    return plain.with_speculative({"method": "ngram", "num_speculative_tokens": 3})


def neighbours() -> list[tuple[list[int], SamplingParams]]:
    """Repetitive prompts (so the n-gram proposer drafts), greedy and seeded sampled."""
    out = []
    for i in range(6):
        prompt = [10 + i, 20 + i, 30 + i, 40 + i] * (2 + i % 3)
        params = (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 == 0
                  else SamplingParams(temperature=0.8, top_k=50, seed=100 + i, max_tokens=12,
                                      ignore_eos=True))
        out.append((prompt, params))
    return out


def poisoned() -> list[tuple[list[int], SamplingParams]]:
    sampled = SamplingParams(temperature=0.9, seed=VERIFY_POISON_SEED, max_tokens=12,
                             ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [([7, 8, FORWARD_POISON, 9] * 3, greedy),
            ([50, 51, 52, PROPOSE_POISON] * 3, greedy),
            ([60, 61, 62, 63] * 3, sampled)]


@pytest.fixture
def poison(llm, monkeypatch):
    """Wrap the real forward, proposal and verification so the poisoned requests raise after
    the real call ran (the batch's KV writes and random draws happened)."""
    execute, propose, verify = llm.target.execute, llm.proposer.propose, core.verify_rows

    def bad_execute(kv_cache, seqs):
        out = execute(kv_cache, seqs)
        if any(FORWARD_POISON in s.token_ids for s in seqs):
            raise ValueError("forward failed on a poisoned token")
        return out

    def bad_propose(asks):
        out = propose(asks)
        if any(PROPOSE_POISON in a.context for a in asks):
            raise IndexError("proposer failed on a poisoned context")
        return out

    def bad_verify(rows):
        out = verify(rows)
        if any(r.params.seed == VERIFY_POISON_SEED for r in rows):
            raise RuntimeError("verification failed on a poisoned seed")
        return out

    monkeypatch.setattr(llm.target, "execute", bad_execute)
    monkeypatch.setattr(llm.proposer, "propose", bad_propose)
    monkeypatch.setattr(core, "verify_rows", bad_verify)


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache
    assert not llm.engine.has_unfinished_requests
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()


def test_poisoned_requests_fail_alone_and_neighbours_are_unchanged(llm, poison):
    clean = llm.generate([p for p, _ in neighbours()], [sp for _, sp in neighbours()])
    assert_all_blocks_free(llm)
    mixed = neighbours()[:3] + poisoned() + neighbours()[3:]
    outs = llm.generate([p for p, _ in mixed], [sp for _, sp in mixed])
    bad = outs[3:6]
    good = outs[:3] + outs[6:]
    assert [o.token_ids for o in good] == [o.token_ids for o in clean]
    assert all(o.finish_reason != "error" and o.error is None for o in good)
    assert [o.finish_reason for o in bad] == ["error"] * 3
    assert "forward failed" in bad[0].error and "ValueError" in bad[0].error
    assert "proposer failed" in bad[1].error
    assert "verification failed" in bad[2].error
    assert llm.engine.stats.spec.num_draft_tokens > 0  # speculation ran beside the failures
    assert_all_blocks_free(llm)


def test_a_step_holding_only_the_poisoned_request_raises(llm, poison):
    """Nothing to isolate: the step's own exception reaches the caller (the async engine
    fails the step's requests with a 500), and the cache is still freed by the abort."""
    prompt, params = poisoned()[0]
    req = llm.make_request(prompt, params)
    llm.add_request(req)
    with pytest.raises(ValueError, match="forward failed"):
        llm.step()
    llm.engine.abort_request(req.request_id)
    assert_all_blocks_free(llm)


def test_async_engine_answers_the_poisoned_request_with_a_400_class_error(llm, poison):
    async def run():
        engine = AsyncEngine(llm, max_waiting=64)
        engine.start()
        mixed = neighbours() + poisoned()[:1]
        streams = engine.submit([llm.make_request(p, sp) for p, sp in mixed], False)
        results = []
        for s in streams:
            try:
                results.append([d async for d in s][-1].output.token_ids)
            except RequestFailedError as exc:
                results.append(exc)
        await engine.shutdown(1.0)
        return results
    clean = llm.generate([p for p, _ in neighbours()], [sp for _, sp in neighbours()])
    results = asyncio.run(run())
    assert results[:-1] == [o.token_ids for o in clean]
    assert isinstance(results[-1], RequestFailedError) and results[-1].status == 400
    assert_all_blocks_free(llm)


# ---- run_isolated itself -------------------------------------------------------------


def test_run_isolated_reports_each_items_failure():
    def batch(items):
        if any(i < 0 for i in items):
            raise ValueError("negative")
        return [2 * i for i in items]
    calls = []
    out = run_isolated(batch, lambda i: batch([i])[0], [1, -2, 3], lambda: calls.append(1))
    assert out[0] == 2 and out[2] == 6 and isinstance(out[1], ValueError)
    assert calls == [1]


@pytest.mark.parametrize("items", [[-1], [-1, -2]], ids=["single", "all-fail"])
def test_run_isolated_raises_when_no_single_item_is_at_fault(items):
    def batch(xs):
        raise ValueError("broken for everyone")
    with pytest.raises(ValueError, match="broken for everyone"):
        run_isolated(batch, lambda i: batch([i])[0], items)
