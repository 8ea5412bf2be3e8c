"""Scheduler: continuous batching, chunked prefill, speculative lookahead, preemption (no torch).

A fake engine drives the scheduler the way the real one does, with a deterministic fake model
(the next token is a function of the context) and a fake KV cache (the token id written at each
block slot), and checks the bookkeeping after every step.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specmoe.config import SchedulerConfig
from specmoe.engine.scheduler import Scheduler, SchedulerOutput
from specmoe.engine.stats import StepStats
from specmoe.request import DraftState, Request, RequestStatus
from specmoe.sampling_params import SamplingParams

WRONG_DRAFT = 1  # never a model token


def _next_token(context: list[int]) -> int:
    return 10 + (context[-1] * 17 + len(context) * 5) % 80


def _greedy(context: list[int], num_tokens: int) -> list[int]:
    tokens = list(context)
    for _ in range(num_tokens):
        tokens.append(_next_token(tokens))
    return tokens[len(context):]


class FakeEngine:
    """Runs steps: schedule, fake forward + greedy verification, update, then next drafts.

    `accept` scripts how many drafts of each proposal are right (cycled per request); the
    drafts past that are wrong, so verification rejects them. Outputs never depend on it.
    """

    def __init__(self, num_blocks=64, *, block_size=4, budget=64, max_num_seqs=8,
                 prefix_caching=True, accept=(1,)):
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                 block_size=block_size, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(config, num_blocks)
        self.kv_cache = self.sched.kv_cache
        self.accept = accept
        self.num_proposals: Counter[str] = Counter()
        self.fake_kv: dict[tuple[int, int], int] = {}  # (block id, slot) -> token id
        self.outputs: dict[str, list[int]] = {}
        self.history: list[SchedulerOutput] = []

    def add(self, request_id: str, prompt: list[int], max_tokens: int, k: int = 0) -> Request:
        req = Request(request_id, None, list(prompt), SamplingParams(max_tokens=max_tokens))
        req.num_speculative_tokens = k
        self.sched.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        sched, bs = self.sched, self.sched.config.block_size
        running_before = [r.request_id for r in sched.running]
        out = sched.schedule()
        self.history.append(out)
        self._check_schedule(out, running_before)
        for s in out.scheduled:  # reads: every computed position holds its token's KV
            tokens = sched.requests[s.request_id].all_token_ids
            for pos in range(s.start_pos):
                assert self.fake_kv.get((s.block_ids[pos // bs], pos % bs)) == tokens[pos], pos
        for s in out.scheduled:  # writes: only into blocks owned alone and not prefix-cached
            for pos, token in enumerate(s.token_ids, s.start_pos):
                block = self.kv_cache.block_pool.blocks[s.block_ids[pos // bs]]
                assert block.ref_cnt == 1 and block.block_hash is None
                self.fake_kv[block.block_id, pos % bs] = token
        num_rejected, sampled = {}, []
        for s in (s for s in out.scheduled if s.num_logits):
            req = sched.requests[s.request_id]
            drafts = s.token_ids[len(s.token_ids) - s.num_draft_tokens:]
            emitted = []
            for draft in drafts + [None]:
                emitted.append(_next_token(req.all_token_ids + emitted))
                if draft != emitted[-1]:
                    break
            num_rejected[s.request_id] = len(drafts) + 1 - len(emitted)
            req.append_output_tokens(
                emitted[:req.params.max_tokens - len(req.output_token_ids)])
            if len(req.output_token_ids) == req.params.max_tokens:
                req.finish_reason = "length"
            sampled.append(req)
        for req in sched.update_from_output(out, num_rejected):
            assert req.status is RequestStatus.FINISHED and not self.kv_cache.has_request(
                req.request_id)
            self.outputs[req.request_id] = req.output_token_ids
        for s in (s for s in out.scheduled if s.request_id in sched.requests):
            computed = s.start_pos + len(s.token_ids) - num_rejected.get(s.request_id, 0)
            assert sched.requests[s.request_id].num_computed_tokens == computed
            assert s.num_logits == 0 or computed == sched.requests[s.request_id].num_tokens - 1
            # Blocks past the kept tokens (rejected drafts' slots) were given back.
            assert len(self.kv_cache.get_block_ids(s.request_id)) == -(-computed // bs)
        self.kv_cache.check_invariants()
        for req in sampled:
            if req.status is RequestStatus.RUNNING and req.num_speculative_tokens:
                k, count = req.num_speculative_tokens, self.num_proposals[req.request_id]
                self.num_proposals[req.request_id] += 1
                good = min(k, self.accept[count % len(self.accept)])
                req.draft = DraftState(_greedy(req.all_token_ids, good) + [WRONG_DRAFT] * (k - good))
        return out

    def run(self) -> None:
        while self.sched.has_unfinished_requests and len(self.history) < 500:
            self.step()
        assert_no_leak(self.sched)  # all finished, nothing held

    def _check_schedule(self, out: SchedulerOutput, running_before: list[str]) -> None:
        sched, kv = self.sched, self.kv_cache
        config = sched.config
        assert out.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(sched.running) <= config.max_num_seqs
        assert out.stats == StepStats(  # used + free == num_blocks
            len(sched.running), len(sched.waiting), len(out.scheduled), out.num_scheduled_tokens,
            sum(s.num_draft_tokens for s in out.scheduled), kv.num_blocks - kv.num_free_blocks,
            kv.num_free_blocks, len(out.preempted_request_ids),
            sum(s.num_logits for s in out.scheduled))
        ids = [s.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)
        for s in out.scheduled:
            req = sched.requests[s.request_id]
            assert req.status is RequestStatus.RUNNING and s.start_pos == req.num_computed_tokens
            assert s.block_ids == kv.get_block_ids(s.request_id)
            # Slots for every computed token, drafts included (lookahead slots).
            assert len(s.block_ids) * config.block_size >= s.start_pos + len(s.token_ids)
            end = s.start_pos + len(s.token_ids) - s.num_draft_tokens
            assert s.token_ids[:end - s.start_pos] == req.all_token_ids[s.start_pos:end]
            assert s.token_ids[end - s.start_pos:] == req.draft.token_ids[:s.num_draft_tokens]
            reaches_end = end == req.num_tokens
            assert s.num_logits == (s.num_draft_tokens + 1 if reaches_end else 0)
            assert reaches_end or s.num_draft_tokens == 0
        preempted = out.preempted_request_ids
        if preempted:  # the newest first, to the head of waiting, and nobody admitted
            assert preempted == running_before[::-1][:len(preempted)]
            assert [r.request_id for r in list(sched.waiting)[:len(preempted)]] == preempted[::-1]
            assert set(ids) <= set(running_before) - set(preempted)
            assert [r.request_id for r in sched.running] == running_before[:-len(preempted)]
        for request_id in preempted:
            req = sched.requests[request_id]
            assert req.status is RequestStatus.PREEMPTED and req.num_computed_tokens == 0
            assert not req.draft and not kv.has_request(request_id)


def assert_no_leak(sched: Scheduler) -> None:
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    assert sched.kv_cache.num_requests == 0 and not sched.running and not sched.waiting
    sched.kv_cache.check_invariants()


def _prompt(seed: int, length: int) -> list[int]:
    return [100 + (seed * 7 + i * 3) % 50 for i in range(length)]


def _steps_of(engine: FakeEngine, request_id: str) -> list:
    return [s for out in engine.history for s in out.scheduled if s.request_id == request_id]


def test_continuous_batching_requests_join_and_leave_under_the_seq_cap():
    engine = FakeEngine(max_num_seqs=2)
    specs = {"a": (_prompt(1, 5), 2), "b": (_prompt(2, 6), 6), "c": (_prompt(3, 7), 3)}
    for request_id, (prompt, max_tokens) in specs.items():
        engine.add(request_id, prompt, max_tokens)
    first = engine.step()
    assert [s.request_id for s in first.scheduled] == ["a", "b"]
    assert [r.request_id for r in engine.sched.waiting] == ["c"]
    specs["d"] = (_prompt(4, 4), 2)
    engine.add("d", *specs["d"])  # joins while others run
    assert engine.step().stats.num_waiting == 2
    assert "a" in engine.outputs  # a finished and left: c takes its place, b keeps decoding
    third = engine.step()
    assert [(s.request_id, s.start_pos, len(s.token_ids), s.num_logits)
            for s in third.scheduled] == [("b", 7, 1, 1), ("c", 0, 7, 1)]
    engine.run()
    assert max(out.stats.num_scheduled_requests for out in engine.history) == 2
    assert engine.outputs == {rid: _greedy(p, n) for rid, (p, n) in specs.items()}


def test_chunked_prefill_splits_a_long_prompt_and_mixes_it_with_decodes():
    engine = FakeEngine(budget=8)
    engine.add("a", _prompt(1, 3), max_tokens=20)
    engine.add("b", _prompt(2, 20), max_tokens=2)
    engine.run()
    assert [(s.start_pos, len(s.token_ids), s.num_logits) for s in _steps_of(engine, "b")] == [
        (0, 5, 0), (5, 7, 0), (12, 7, 0), (19, 1, 1), (20, 1, 1)]
    # Each of b's chunks shares its step with a's decode, which comes first.
    assert [[(s.request_id, s.num_logits) for s in out.scheduled]
            for out in engine.history[:4]] == [[("a", 1), ("b", 0)]] * 3 + [[("a", 1), ("b", 1)]]
    assert [out.num_scheduled_tokens for out in engine.history[:4]] == [8, 8, 8, 2]
    assert engine.outputs == {"a": _greedy(_prompt(1, 3), 20), "b": _greedy(_prompt(2, 20), 2)}


def test_drafts_get_lookahead_slots_and_rejected_ones_give_their_blocks_back():
    engine = FakeEngine(num_blocks=16, accept=(0, 3, 2))
    req = engine.add("a", _prompt(1, 6), max_tokens=12, k=3)
    rows = []
    for _ in range(4):
        s = engine.step().scheduled[0]
        rows.append((s.start_pos, len(s.token_ids), s.num_draft_tokens, s.num_logits,
                     len(s.block_ids), len(engine.kv_cache.get_block_ids("a")),
                     req.num_computed_tokens, req.num_tokens))
    # (start, tokens, drafts, logits, blocks scheduled, blocks kept, computed, verified tokens)
    assert rows == [(0, 6, 0, 1, 2, 2, 6, 7),
                    (6, 4, 3, 4, 3, 2, 7, 8),  # all 3 drafts rejected: 1 block back
                    (7, 4, 3, 4, 3, 3, 11, 12),  # all accepted
                    (11, 4, 3, 4, 4, 4, 14, 15)]  # 1 rejected, within the kept block
    assert engine.kv_cache.num_free_blocks == 16 - 4
    engine.run()
    assert engine.outputs["a"] == _greedy(_prompt(1, 6), 12)


@pytest.mark.parametrize("budget, b_drafts", [(7, 1), (6, 0)])
def test_drafts_are_cut_to_what_is_left_of_the_budget(budget, b_drafts):
    engine = FakeEngine(budget=budget, accept=(4,))
    engine.add("a", _prompt(1, 3), max_tokens=9, k=4)
    engine.add("b", _prompt(2, 3), max_tokens=9, k=4)
    engine.step()
    out = engine.step()
    assert [(s.num_draft_tokens, s.num_logits) for s in out.scheduled] == [
        (4, 5), (b_drafts, b_drafts + 1)]
    assert out.num_scheduled_tokens == 5 + 1 + b_drafts
    engine.run()


def test_a_request_filling_the_whole_cache_drops_its_drafts_instead_of_preempting():
    engine = FakeEngine(num_blocks=3, accept=(3,))  # 12 slots
    engine.add("a", _prompt(1, 9), max_tokens=3, k=3)  # 9 + 3 = 12 fits, with drafts not
    engine.run()
    assert [(s.num_draft_tokens, s.num_logits) for s in _steps_of(engine, "a")] == [
        (0, 1), (0, 1), (0, 1)]
    assert engine.sched.num_preemptions == 0
    assert engine.outputs["a"] == _greedy(_prompt(1, 9), 3)


def test_preemption_recomputes_the_newest_request_and_keeps_its_output():
    engine = FakeEngine(num_blocks=6, max_num_seqs=3)
    prompts = {rid: _prompt(seed, 4) for seed, rid in enumerate("abcd")}
    reqs = [engine.add("a", prompts["a"], 10), engine.add("b", prompts["b"], 10, k=2),
            engine.add("c", prompts["c"], 10), engine.add("d", prompts["d"], 4)]
    a, b = reqs[:2]
    for _ in range(4):
        engine.step()
    out = engine.step()
    assert out.preempted_request_ids == ["c"]  # a needed a block; c is the newest
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in engine.sched.waiting] == ["c", "d"]  # none admitted
    engine.step()
    out = engine.step()
    assert out.scheduled[1].num_draft_tokens == 0  # b dropped its own drafts to fit
    assert out.preempted_request_ids == []
    assert b.draft  # fresh drafts pending
    b_tokens = list(b.all_token_ids)
    out = engine.step()
    assert out.preempted_request_ids == ["b"] and [s.request_id for s in out.scheduled] == ["a"]
    assert (b.status, b.num_computed_tokens, b.draft.token_ids) == (
        RequestStatus.PREEMPTED, 0, [])
    assert [r.request_id for r in engine.sched.waiting] == ["b", "c", "d"]
    assert out.stats.num_preempted == 1
    engine.run()
    resumed = _steps_of(engine, "b")[7]  # b ran in steps 0-6
    # Resumption recomputes prompt + outputs, minus the blocks the prefix cache kept.
    assert resumed.start_pos > 0 and resumed.start_pos % 4 == 0
    assert resumed.token_ids == b_tokens[resumed.start_pos:] and resumed.num_logits == 1
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    assert (engine.sched.num_preemptions == sum(r.num_preemptions for r in reqs)
            == sum(out.stats.num_preempted for out in engine.history) == 2)
    assert engine.outputs == {rid: _greedy(prompts[rid], r.params.max_tokens)
                              for rid, r in zip("abcd", reqs)}


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_cache_hits_share_blocks_with_a_running_and_a_finished_request(prefix_caching):
    engine = FakeEngine(prefix_caching=prefix_caching)
    shared = _prompt(5, 13)
    engine.add("a", shared + [7], max_tokens=4)
    engine.step()
    engine.add("b", shared + [8, 9], max_tokens=3)
    b_first = engine.step().scheduled[1]
    a_blocks, b_blocks = (engine.kv_cache.get_block_ids(rid) for rid in "ab")
    pool = engine.kv_cache.block_pool
    if prefix_caching:
        assert (b_first.start_pos, b_first.token_ids) == (12, [shared[12], 8, 9])
        assert b_blocks[:3] == a_blocks[:3] and b_blocks[3] != a_blocks[3]
        assert [pool.blocks[i].ref_cnt for i in b_blocks] == [2, 2, 2, 1]
        assert engine.kv_cache.prefix_cache_hit_rate == pytest.approx(12 / (14 + 15))
    else:
        assert b_first.start_pos == 0 and not set(a_blocks) & set(b_blocks)
    engine.run()
    engine.add("c", shared + [7], max_tokens=2)  # a's freed blocks stay cached
    assert engine.step().scheduled[0].start_pos == (12 if prefix_caching else 0)
    engine.run()
    assert engine.outputs["c"] == _greedy(shared + [7], 2)
    assert engine.kv_cache.prefix_cache_hit_rate == (
        pytest.approx(24 / (14 + 15 + 14)) if prefix_caching else 0.0)


def test_abort_frees_a_running_and_a_waiting_request():
    engine = FakeEngine(num_blocks=16, max_num_seqs=1)
    a = engine.add("a", _prompt(1, 6), max_tokens=10, k=2)
    b = engine.add("b", _prompt(2, 6), max_tokens=10)
    for _ in range(2):
        engine.step()
    num_free, num_held = engine.kv_cache.num_free_blocks, len(engine.kv_cache.get_block_ids("a"))
    assert engine.sched.abort_request("a") is a
    assert a.status is RequestStatus.FINISHED and not engine.sched.running
    assert engine.kv_cache.num_free_blocks == num_free + num_held
    assert engine.sched.abort_request("b") is b and not engine.sched.waiting
    assert engine.sched.abort_request("b") is None and engine.sched.abort_request("x") is None
    assert_no_leak(engine.sched)
    # Aborted between schedule and update: the update skips it.
    engine.add("c", _prompt(3, 5), max_tokens=4)
    out = engine.sched.schedule()
    engine.sched.abort_request("c")
    assert engine.sched.update_from_output(out, {}) == []
    assert_no_leak(engine.sched)


def test_add_request_rejects_duplicate_ids_and_requests_larger_than_the_cache():
    engine = FakeEngine(num_blocks=4)  # 16 slots
    engine.add("a", _prompt(1, 10), max_tokens=6)  # exactly fits
    with pytest.raises(ValueError, match="duplicate request_id='a'"):
        engine.add("a", _prompt(2, 3), max_tokens=1)
    with pytest.raises(ValueError,
                       match=r"needs up to 17 tokens .*\(prompt 10 \+ max_tokens 7\).*holds 16"):
        engine.add("big", _prompt(2, 10), max_tokens=7)
    assert list(engine.sched.requests) == ["a"] and len(engine.sched.waiting) == 1
    engine.run()
    assert engine.outputs == {"a": _greedy(_prompt(1, 10), 6)}


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_under_memory_pressure_matches_unbatched_greedy(prefix_caching, seed):
    rng = random.Random(seed)
    engine = FakeEngine(num_blocks=10, budget=12, max_num_seqs=4,
                        prefix_caching=prefix_caching, accept=(0, 2, 4, 1, 3))
    prefixes = [_prompt(i, 9) for i in range(3)]
    arrivals = sorted((rng.randrange(20), f"r{i}") for i in range(12))
    specs, aborted = {}, set()
    for step in range(400):
        for _, request_id in [a for a in arrivals if a[0] == step]:
            prompt = rng.choice(prefixes)[:rng.randrange(2, 10)] + _prompt(step, rng.randrange(5))
            specs[request_id] = (prompt, rng.randrange(1, 20))
            engine.add(request_id, *specs[request_id], k=rng.randrange(5))
        if step in (12, 20) and engine.sched.requests:  # abort someone, wherever it is
            victim = rng.choice(sorted(engine.sched.requests))
            aborted.add(engine.sched.abort_request(victim).request_id)
        if step >= 20 and not engine.sched.has_unfinished_requests:
            break
        engine.step()
    assert_no_leak(engine.sched)
    assert engine.outputs == {rid: _greedy(p, n) for rid, (p, n) in specs.items()
                              if rid not in aborted}
    assert engine.sched.num_preemptions > 0
    assert any(s.num_logits == 0 for out in engine.history for s in out.scheduled)  # chunks
    assert (engine.kv_cache.prefix_cache_hit_rate > 0) == prefix_caching


def test_prompt_blocks_of_a_request_finished_after_prefill_are_prefix_cached():
    engine = FakeEngine()
    engine.add("a", _prompt(6, 9), max_tokens=1)
    engine.run()
    engine.add("b", _prompt(6, 9), max_tokens=1)
    assert engine.step().scheduled[0].start_pos == 8


def test_prefix_cache_lookups_are_counted_once_per_admission():
    engine = FakeEngine(num_blocks=4)
    engine.add("a", _prompt(1, 13), max_tokens=3)  # takes all 4 blocks for 3 steps
    engine.add("b", _prompt(2, 2), max_tokens=1)
    engine.run()
    stats = engine.kv_cache.block_pool.prefix_cache_stats
    assert (stats.num_queries, stats.num_query_tokens) == (2, 13 + 2)


def test_prompt_rows_ahead_are_the_next_steps_prompt_chunks():
    """Without prefix-cache hits or a full KV cache, `prompt_rows_ahead` is exactly the rows
    of prompt chunks (running requests' remaining prompts, then admitted waiting ones) the
    next step computes beside its decoding rows."""
    eng = FakeEngine(num_blocks=256, budget=64, max_num_seqs=3, prefix_caching=False)
    for i, (length, max_tokens) in enumerate([(10, 4), (100, 3), (30, 6), (5, 2), (70, 3)]):
        eng.add(f"r{i}", [20 + (i + j) % 50 for j in range(length)], max_tokens)
    seen = set()
    while eng.sched.has_unfinished_requests:
        gaps = {r.request_id: r.num_tokens - r.num_computed_tokens for r in eng.sched.running}
        decode_rows = sum(gap == 1 for gap in gaps.values())
        ahead = eng.sched.prompt_rows_ahead(decode_rows)
        out = eng.step()
        assert ahead == sum(len(s.token_ids) - s.num_draft_tokens for s in out.scheduled
                            if gaps.get(s.request_id, 2) > 1)
        seen.add(ahead)
    assert {0, 63, 64} <= seen  # decode-only steps; chunks cut by the budget, one beside a decode
