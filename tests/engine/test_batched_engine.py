"""The batched engine end to end on the real SmolLM2-135M (GGUF, fp32).

- Batch invariance: each prompt's greedy output is the same run alone, in a batch of 16 of mixed
  lengths (one prefilled in chunks), with n-gram or draft-model speculation, and with K
  differing per request (0 turns it off), and under preemption.
- Speculation paused from a batch size on (disable_by_batch_size): no drafts while the batch
  is that large, drafts again when it shrinks, outputs unchanged.
- Seed isolation: a seeded sampled request gives the same output alone or beside others.
- Prefix caching: hits give the same output as misses.
- No leak: after every scenario (EOS, stop string, max_tokens, preemption, abort) the KV cache
  pools (the target's and the draft's) hold every block again.
"""

from __future__ import annotations

import dataclasses

import pytest

from specmoe import LLM, SamplingParams
from specmoe.utils.data import load_prompts

BUDGET = 128  # tokens per step: the long prompt is prefilled in several chunks
SCHEDULER = {"max_num_seqs": 16, "max_num_batched_tokens": BUDGET, "block_size": 16}


@pytest.fixture(scope="module")
def plain(smollm2) -> LLM:
    return LLM(smollm2, dtype="float32", scheduler=SCHEDULER)


@pytest.fixture(scope="module")
def ngram(plain) -> LLM:
    return plain.with_speculative({"method": "ngram", "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def draft(plain, smollm2) -> LLM:
    return plain.with_speculative({"method": "draft", "draft_model": smollm2,
                                   "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def prompts(plain) -> list[str]:
    """16 real prompts: 10 chat-wrapped Spec-Bench questions, 5 raw text prompts of 1 to a
    few tokens, and one long prompt (> 2 step budgets)."""
    questions = load_prompts("spec_bench", limit=40)
    chats = [plain.chat_prompt([{"role": "user", "content": q.text}]) for q in questions[::4]]
    raw = ["def", "1, 2, 3,", "The capital of France is", "import numpy as np\n", "Once"]
    long = " ".join(q.text for q in questions[:12])
    out = chats + raw + [long]
    assert len(plain.tokenizer.encode(long)) > 2 * BUDGET
    return out


def _greedy(i: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8 + 3 * (i % 6), ignore_eos=True, **kwargs)


def _assert_no_leak(*llms: LLM) -> None:
    for llm in llms:
        kv = llm.engine.scheduler.kv_cache
        assert not llm.engine.has_unfinished_requests
        assert kv.num_free_blocks == kv.num_blocks
        kv.check_invariants()
        draft_kv = getattr(llm.proposer, "kv_cache", None)
        if draft_kv is not None:
            assert draft_kv.num_free_blocks == draft_kv.num_blocks
            draft_kv.check_invariants()


@pytest.fixture(scope="module")
def alone(plain, prompts) -> list[list[int]]:
    return [plain.generate([p], _greedy(i))[0].token_ids for i, p in enumerate(prompts)]


def test_batch_of_16_equals_each_prompt_alone(plain, prompts, alone):
    outs = plain.generate(prompts, [_greedy(i) for i in range(len(prompts))])
    assert [o.token_ids for o in outs] == alone
    assert plain.engine.stats.max_batch_size == 16
    assert all(o.finish_reason == "length" for o in outs)
    _assert_no_leak(plain)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_batch_with_per_request_k_equals_alone(request, proposer, prompts, alone):
    llm = request.getfixturevalue(proposer)
    ks = [None, 0, 1, 2, 4, 3]
    params = [_greedy(i, num_speculative_tokens=ks[i % len(ks)]) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert sum(o.spec_stats.num_drafts for o in outs) > 0
    for o, p in zip(outs, params):
        if p.num_speculative_tokens == 0:
            assert o.spec_stats.num_drafts == 0  # K = 0 turns speculation off for it alone
    _assert_no_leak(llm)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculation_pauses_at_the_batch_size_limit_and_stays_lossless(request, proposer,
                                                                      prompts, alone):
    """disable_by_batch_size=4: after a step that leaves 4 or more requests running, the next
    step verifies no drafts; as requests finish (max_tokens 8-23) drafting resumes (the
    draft model catching up on the tokens it skipped) and every output equals the plain one."""
    base = request.getfixturevalue(proposer)
    llm = base.with_speculative(dataclasses.replace(base.config.speculative,
                                                    disable_by_batch_size=4))
    core, trace = llm.engine, []  # (requests running after the step, its draft tokens)
    step = core.step

    def traced():
        finished = step()
        trace.append((len(core.scheduler.running), core.stats.last_step.num_draft_tokens))
        return finished

    core.step = traced
    outs = llm.generate(prompts, [_greedy(i) for i in range(len(prompts))])
    assert [o.token_ids for o in outs] == alone
    assert all(drafts == 0 for (running, _), (_, drafts) in zip(trace, trace[1:])
               if running >= 4)
    assert core.stats.num_spec_paused_steps == sum(running >= 4 for running, _ in trace)
    assert any(drafts for _, drafts in trace)  # drafting resumed for the last requests
    _assert_no_leak(llm)


def test_batch_size_table_sets_k_by_running_requests_and_stays_lossless(draft, prompts, alone):
    """{"1-2": 3, "3-5": 1, "6-16": 0}: after a step that leaves B requests running, the next
    step drafts at most the K of B's range per request (none from 6 on), and requests that set
    their own smaller K keep it."""
    llm = draft.with_speculative(dataclasses.replace(
        draft.config.speculative, policy="batch_size_table",
        batch_size_table={"1-2": 3, "3-5": 1, "6-16": 0}))
    core, trace, own_k = llm.engine, [], []  # (running after the step, next drafts per request)
    step = core.step

    def traced():
        finished = step()
        drafts = [len(r.draft) for r in core.scheduler.running]
        trace.append((len(core.scheduler.running), drafts))
        own_k.extend(len(r.draft) for r in core.scheduler.running
                     if r.params.num_speculative_tokens == 2)
        return finished

    core.step = traced
    params = [_greedy(i) for i in range(len(prompts))]
    params[-1] = _greedy(len(prompts) - 1, num_speculative_tokens=2)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    cap = {**dict.fromkeys(range(1, 3), 3), **dict.fromkeys(range(3, 6), 1)}
    for running, drafts in trace:
        assert all(d <= cap.get(running, 0) for d in drafts), (running, drafts)
    assert any(running <= 2 and max(drafts, default=0) > 1 for running, drafts in trace)
    assert any(running in (3, 4, 5) and max(drafts, default=0) == 1 for running, drafts in trace)
    assert core.stats.num_spec_paused_steps == sum(running >= 6 for running, _ in trace)
    assert own_k and max(own_k) <= 2
    _assert_no_leak(llm)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_adaptive_policy_is_lossless_and_reports_its_choices(request, proposer, prompts, alone):
    """policy="adaptive": outputs equal the plain ones, no request drafts past its own K, the
    K histogram counts every (request, step) that could draft, and once the step-time model
    is calibrated every step's prediction error is recorded."""
    base = request.getfixturevalue(proposer)
    llm = base.with_speculative(dataclasses.replace(base.config.speculative, policy="adaptive"))
    core, own_k, k_max = llm.engine, [], llm.config.speculative.num_speculative_tokens
    step = core.step

    def traced():
        finished = step()
        own_k.extend(len(r.draft) for r in core.scheduler.running
                      if r.params.num_speculative_tokens == 1)
        return finished

    core.step = traced
    params = [_greedy(i) for i in range(len(prompts))]
    params[0] = _greedy(0, num_speculative_tokens=1)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    stats = core.stats.to_dict()
    hist = stats["draft_k_histogram"]
    assert hist and set(hist) <= set(range(k_max + 1))
    assert max(own_k, default=0) <= 1
    assert core.stats.step_time_errors and stats["step_time_prediction_median_error"] >= 0
    _assert_no_leak(llm)


def test_cutting_prompt_lookup_proposals_keeps_outputs_and_counts_the_cut(ngram, prompts,
                                                                         alone):
    """Every n-gram proposal cut to half its drafts once the step-time model is fitted
    (`AdaptivePolicy.trim`): the outputs are the plain ones and the engine counts the cut
    drafts."""
    llm = ngram.with_speculative(dataclasses.replace(ngram.config.speculative,
                                                     policy="adaptive"))
    core, cut = llm.engine, []
    choose = core.policy.choose

    def chosen(*args, **kwargs):  # every step as if a solve chose it
        ks = choose(*args, **kwargs)
        core.policy._expect = (len(ks), (1.0, 1.0))
        return ks
    core.policy.choose = chosen

    def half(match_lengths, proposed, step_s, explore=True):
        assert step_s(proposed) > 0
        if explore:  # a verified proposal's cut, not a shadow's (counted apart)
            cut.extend(p - p // 2 for p in proposed)
        return [p // 2 for p in proposed]
    core.policy.matches.cut = half
    # the cut beside prompt chunks counts with the trimmed drafts: kept out of this count
    core.policy.beside_prompts = lambda request_ids, drafts, *rows: list(drafts)
    outs = llm.generate(prompts, [_greedy(i) for i in range(len(prompts))])
    assert [o.token_ids for o in outs] == alone
    assert sum(cut) > 0 and core.stats.num_trimmed_draft_tokens == sum(cut)
    assert core.stats.to_dict()["num_trimmed_draft_tokens"] == sum(cut)
    _assert_no_leak(llm)


def test_drafts_cut_beside_a_prompt_chunk_keep_outputs_and_blocks(ngram, prompts, alone):
    """Before each step that also computes prompt chunks (here the prompts that did not fit
    the first steps' token budget), the decoding requests' drafts go to
    `AdaptivePolicy.beside_prompts`: cut to half there (forced), the outputs are the plain
    ones, the cut drafts are counted, the prompt rows it is told are the scheduler's, and
    every KV block comes back."""
    llm = ngram.with_speculative(dataclasses.replace(ngram.config.speculative,
                                                     policy="adaptive"))
    core, calls = llm.engine, []

    def half(request_ids, drafts, base_rows, prompt_rows):
        assert base_rows == len(request_ids) == len(drafts) and prompt_rows > 0
        assert prompt_rows == core.scheduler.prompt_rows_ahead(base_rows)
        calls.append(sum(d - d // 2 for d in drafts))
        return [d // 2 for d in drafts]
    core.policy.beside_prompts = half
    outs = llm.generate(prompts, [_greedy(i) for i in range(len(prompts))])
    assert [o.token_ids for o in outs] == alone
    assert calls and sum(calls) > 0
    assert core.stats.num_trimmed_draft_tokens >= sum(calls)
    _assert_no_leak(llm)


def test_shadow_drafts_of_held_requests_resolve_to_what_the_target_emitted(ngram, prompts,
                                                                           alone):
    """Every request held at K = 0 (the policy's choice forced): prompt lookup still
    proposes for it every `shadow_every` tokens, never verified, and each shadow's accepted
    count is the run of its drafts the request then emitted; the outputs are the plain
    ones and the engine counts the shadows."""
    llm = ngram.with_speculative(dataclasses.replace(ngram.config.speculative,
                                                     policy="adaptive"))
    core = llm.engine
    assert core.policy.shadow.every == core.policy.s.shadow_every
    core.policy.choose = lambda ids, *args, **kwargs: dict.fromkeys(ids, 0)
    proposed, outcomes = {}, {}
    propose, observe = core.proposer.propose, core.policy.observe_shadow

    def traced_propose(asks):
        out = propose(asks)
        for ask, p in zip(asks, out):  # the context is the request's live token list
            proposed.setdefault(ask.request_id, []).append(
                (ask.context, len(ask.context), p.token_ids[:ask.max_num_draft_tokens]))
        return out

    def traced_observe(outcome, base_rows):
        outcomes.setdefault(outcome.request_id, []).append(outcome)
        return observe(outcome, base_rows)
    core.proposer.propose, core.policy.observe_shadow = traced_propose, traced_observe
    outs = llm.generate(prompts, [_greedy(i) for i in range(len(prompts))])
    assert [o.token_ids for o in outs] == alone
    checked = 0
    for rid, shadows in outcomes.items():
        for (tokens, start, drafts), out in zip(proposed[rid], shadows):  # in issue order
            emitted = tokens[start:start + len(drafts)]
            run = next((i for i, (d, e) in enumerate(zip(drafts, emitted)) if d != e),
                       len(drafts))
            assert (out.drafted, out.accepted) == (len(drafts), run)
            checked += bool(drafts)
    drafted = sum(o.drafted for v in outcomes.values() for o in v)
    accepted = sum(o.accepted for v in outcomes.values() for o in v)
    assert checked > 10 and 0 < accepted < drafted
    stats = core.stats.to_dict()
    assert stats["num_shadow_draft_tokens"] == drafted
    assert stats["num_shadow_accepted_tokens"] == accepted
    assert stats["spec_decode"]["num_draft_tokens"] == 0
    assert not core.policy.shadow.open_ids
    _assert_no_leak(llm)


def test_preemption_keeps_outputs_and_leaks_nothing(smollm2, prompts, alone):
    """A cache of 40 blocks (640 tokens: the long prompt fits) cannot hold 16 requests: the
    newest are preempted, recomputed later, and still produce the same tokens."""
    small = LLM(smollm2, dtype="float32", scheduler={**SCHEDULER, "num_kv_blocks": 40},
                speculative={"method": "ngram", "num_speculative_tokens": 4})
    outs = small.generate(prompts, [_greedy(i) for i in range(len(prompts))])
    assert [o.token_ids for o in outs] == alone
    assert small.engine.stats.num_preemptions > 0
    _assert_no_leak(small)


def test_seeded_request_is_isolated_from_its_neighbours(ngram, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24,
                            ignore_eos=True)
    solo = ngram.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=20) for s in range(5)]
    others += [SamplingParams(temperature=0.7, max_tokens=16), _greedy(0)]
    outs = ngram.generate([prompts[0]] + prompts[1:8], [seeded] + others)
    assert outs[0].token_ids == solo
    _assert_no_leak(ngram)


def test_prefix_cache_hits_give_the_same_output_as_misses(smollm2, plain, prompts):
    shared = prompts[-1]  # the long prompt: many full blocks to hit
    suffixes = [" Summarise.", " Translate.", " Continue:", ""]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    uncached = LLM(smollm2, dtype="float32",
                   scheduler={**SCHEDULER, "enable_prefix_caching": False})
    misses = uncached.generate([shared + s for s in suffixes], params)
    kv = plain.engine.scheduler.kv_cache
    hits_before = kv.block_pool.prefix_cache_stats.num_hit_tokens
    plain.generate([shared], params)  # warm the cache
    hits = plain.generate([shared + s for s in suffixes], params)
    assert kv.block_pool.prefix_cache_stats.num_hit_tokens - hits_before >= 4 * 2 * BUDGET
    assert [o.token_ids for o in hits] == [o.token_ids for o in misses]
    _assert_no_leak(plain, uncached)


SHORT_ANSWERS = ["Answer with one word: is the sky blue?", "What is 2 + 2? Reply with the number.",
                 "Say hello.", "Name one colour."]


@pytest.mark.parametrize("case", ["eos", "stop_string", "max_tokens"])
def test_every_finish_returns_all_blocks(draft, prompts, case):
    params = {"eos": SamplingParams(temperature=0, max_tokens=48),
              "stop_string": SamplingParams(temperature=0, max_tokens=64, stop=["."]),
              "max_tokens": SamplingParams(temperature=0.9, seed=5, max_tokens=7)}[case]
    if case == "eos":  # questions SmolLM2 answers in a few tokens, then emits EOS
        prompts = [draft.chat_prompt([{"role": "user", "content": q}]) for q in SHORT_ANSWERS]
    outs = draft.generate(prompts[:10], params)
    if case == "eos":
        assert all(o.finish_reason == "stop" and o.stop_reason is None for o in outs)
    if case == "stop_string":
        assert any(o.stop_reason == "." for o in outs)
    _assert_no_leak(draft)


def test_step_api_abort_mid_generation(draft, prompts):
    """The server's path: add requests, step, abort one while it holds KV blocks."""
    reqs = [draft.make_request(p, _greedy(5), request_id=f"r{i}")
            for i, p in enumerate(prompts[:4])]
    for req in reqs:
        draft.add_request(req)
    finished = []
    for _ in range(3):
        finished += draft.step()
    assert draft.engine.scheduler.kv_cache.num_free_blocks < draft.engine.scheduler.kv_cache.num_blocks
    aborted = draft.engine.abort_request("r1")
    assert aborted is not None and aborted.finish_reason == "abort"
    while draft.engine.has_unfinished_requests:
        finished += draft.step()
    assert sorted(o.request_id for o in finished) == ["r0", "r2", "r3"]
    assert draft.engine.abort_request("r1") is None
    _assert_no_leak(draft)
