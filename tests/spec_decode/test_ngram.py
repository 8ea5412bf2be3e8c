"""Prompt-lookup (n-gram) drafting: find_ngram_continuation and NgramProposer, then the
engine with an n-gram proposer at the edges: the context limit and a tiny max_tokens."""

from __future__ import annotations

import random

import pytest

from specmoe import SamplingParams, SpeculativeConfig
from specmoe.spec_decode.ngram import NgramProposer, find_ngram_continuation
from specmoe.spec_decode.proposer import ProposeRequest


def _reference(context: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Plain-Python statement of the rule: longest n first, latest earlier match."""
    if num_tokens <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if len(context) < n + 1:
            continue
        suffix = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):  # i + n < len(context)
            if context[i:i + n] == suffix:
                return context[i + n:i + n + num_tokens]
    return []


# ------------------------------------------------------------------ find_ngram_continuation


def test_no_match_returns_empty():
    assert find_ngram_continuation([1, 2, 3, 4, 5], 1, 3, 4) == []


@pytest.mark.parametrize("context", [[], [7]])
def test_context_of_length_0_or_1_returns_empty(context):
    assert find_ngram_continuation(context, 1, 3, 4) == []


def test_context_shorter_than_n_plus_one_returns_empty():
    # Only n = 2 is allowed; [5, 5] has no earlier 2-gram before its suffix.
    assert find_ngram_continuation([5, 5], 2, 3, 4) == []
    assert find_ngram_continuation([5, 6, 5], 3, 3, 4) == []
    # With n = 1 allowed the same context matches.
    assert find_ngram_continuation([5, 5], 1, 3, 4) == [5]


def test_match_picks_the_latest_occurrence():
    context = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    assert find_ngram_continuation(context, 2, 2, 3) == [4, 8, 1]
    assert find_ngram_continuation(context, 1, 1, 2) == [4, 8]


def test_match_prefers_the_longest_n():
    # 3-gram [7, 8, 9] occurs at 0 (-> 10); 1-gram [9] occurs later at 5 (-> 11).
    context = [7, 8, 9, 10, 5, 9, 11, 7, 8, 9]
    assert find_ngram_continuation(context, 1, 3, 3) == [10, 5, 9]
    assert find_ngram_continuation(context, 1, 2, 3) == [10, 5, 9]  # [8, 9] also at 1
    assert find_ngram_continuation(context, 1, 1, 3) == [11, 7, 8]


def test_falls_back_to_shorter_n():
    context = [1, 2, 3, 4, 3]  # no [x, 3] repeats, but [3] does
    assert find_ngram_continuation(context, 1, 3, 2) == [4, 3]
    assert find_ngram_continuation(context, 2, 3, 2) == []


def test_overlapping_match():
    assert find_ngram_continuation([5, 5, 5], 2, 2, 4) == [5]
    assert find_ngram_continuation([1, 2, 1, 2, 1], 3, 3, 4) == [2, 1]


@pytest.mark.parametrize("num_tokens", [-3, -1, 0])
def test_non_positive_num_tokens_returns_empty(num_tokens):
    assert find_ngram_continuation([1, 2, 3, 1, 2], 1, 3, num_tokens) == []


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 50])
def test_proposal_never_exceeds_num_tokens(num_tokens):
    context = [3, 1, 4, 1, 5, 9, 2, 6] * 4 + [3, 1, 4]
    out = find_ngram_continuation(context, 1, 3, num_tokens)
    assert 0 < len(out) <= num_tokens
    assert out == context[3:3 + num_tokens][:len(out)]


def test_proposal_truncated_at_end_of_context():
    context = [1, 2, 3, 1, 2]  # match at 0 -> continuation [3, 1, 2], then the context ends
    assert find_ngram_continuation(context, 2, 2, 10) == [3, 1, 2]
    assert find_ngram_continuation([4, 6, 4], 1, 1, 10) == [6, 4]


def test_matches_reference_on_random_contexts():
    rng = random.Random(0)
    for case in range(800):  # short contexts over 4 tokens; then long ones, larger vocabularies
        vocab, most = (4, 25) if case < 500 else (rng.choice((2, 8, 50)), 300)
        context = [rng.randrange(vocab) for _ in range(rng.randrange(0, most))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        num_tokens = rng.randint(-1, 6)
        assert find_ngram_continuation(context, min_n, max_n, num_tokens) == _reference(
            context, min_n, max_n, num_tokens), (context, min_n, max_n, num_tokens)


# ------------------------------------------------------------------ NgramProposer


def _propose_request(context: list[int], num_tokens: int, request_id: str = "r0"
                     ) -> ProposeRequest:
    return ProposeRequest(request_id, context, num_tokens, SamplingParams(temperature=0), None)


def test_proposer_proposes_deterministic_continuation():
    proposer = NgramProposer(1, 3)
    proposal, = proposer.propose([_propose_request([1, 2, 3, 4, 1, 2], 2)])
    proposer.free("r0")
    assert proposal.token_ids == [3, 4]
    assert proposal.probs is None  # q is one-hot on each proposed token


@pytest.mark.parametrize("num_tokens", [-1, 0, 1, 3, 8])
def test_proposer_respects_num_tokens(num_tokens):
    proposer = NgramProposer(1, 2)
    proposal, = proposer.propose([_propose_request([1, 2, 3, 4, 5, 6, 1, 2], num_tokens)])
    assert proposal.token_ids == [3, 4, 5, 6, 1, 2][:max(num_tokens, 0)]


def test_proposer_drafts_each_request_of_a_batch_from_its_own_context():
    proposals = NgramProposer(1, 2).propose([
        _propose_request([1, 2, 3, 1, 2], 3, "a"), _propose_request([7, 8], 3, "b"),
        _propose_request([5, 6, 9, 5], 1, "c")])
    assert [p.token_ids for p in proposals] == [[3, 1, 2], [], [6]]


@pytest.mark.parametrize("min_n, max_n", [(0, 2), (-1, 1), (3, 2), (0, 0)])
def test_proposer_invalid_range_raises(min_n, max_n):
    with pytest.raises(ValueError, match="n-gram range"):
        NgramProposer(min_n, max_n)


@pytest.mark.parametrize("min_n, max_n", [(0, 2), (3, 2)])
def test_speculative_config_invalid_range_raises(min_n, max_n):
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig("ngram", prompt_lookup_min=min_n, prompt_lookup_max=max_n)


# ------------------------------------------------------------------ engine (SmolLM2, fp32)

MAX_MODEL_LEN = 64
K = 8


@pytest.fixture(scope="module")
def llm():
    from specmoe import LLM
    from specmoe.loader.aliases import ALIASES
    try:
        ALIASES["smollm2-135m"].path()
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2-135M GGUF not installed: {exc}")
    return LLM("smollm2-135m", dtype="float32", max_model_len=MAX_MODEL_LEN,
               speculative={"method": "ngram", "num_speculative_tokens": K,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3})


@pytest.fixture(scope="module")
def repetitive_ids(llm) -> list[int]:
    text = "one two three four five six seven eight, " * 20
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def proposal_log(llm, monkeypatch):
    """Records (context length, num_tokens asked, tokens proposed) of every propose call."""
    log = []
    inner = llm.proposer.propose

    def spy(reqs):
        proposals = inner(reqs)
        log.extend((len(r.context), r.max_num_draft_tokens, len(p.token_ids))
                   for r, p in zip(reqs, proposals))
        return proposals

    monkeypatch.setattr(llm.proposer, "propose", spy)
    return log


def _assert_stats_consistent(out) -> None:
    stats = out.spec_stats
    assert stats.num_accepted_tokens <= stats.num_draft_tokens <= K * stats.num_drafts
    assert sum(stats.num_accepted_per_position) == stats.num_accepted_tokens
    assert stats.num_accepted_tokens <= stats.num_emitted_tokens
    assert stats.num_emitted_tokens <= stats.num_accepted_tokens + stats.num_drafts
    assert stats.num_emitted_tokens <= len(out.token_ids) - 1  # the prefill token is not


@pytest.mark.parametrize("room", [10, 1])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_stops_at_context_limit(llm, repetitive_ids, proposal_log, room,
                                           temperature):
    prompt = repetitive_ids[:MAX_MODEL_LEN - room]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=100, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == MAX_MODEL_LEN
    for context_len, num_tokens, num_proposed in proposal_log:
        assert num_tokens <= min(K, MAX_MODEL_LEN - context_len - 1)
        assert num_proposed <= num_tokens
    if room > 1:
        assert out.spec_stats.num_drafts > 0  # the repetitive prompt gives n-gram matches
    _assert_stats_consistent(out)


def test_context_limit_greedy_matches_plain_decoding(llm, repetitive_ids):
    prompt = repetitive_ids[:MAX_MODEL_LEN - 10]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    spec = llm.generate([prompt], params)[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100,
                                                  ignore_eos=True, num_speculative_tokens=0))[0]
    assert spec.token_ids == plain.token_ids
    assert plain.spec_stats.num_drafts == 0
    assert spec.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_tiny_max_tokens_with_large_k(llm, repetitive_ids, proposal_log, max_tokens):
    prompt = repetitive_ids[:30]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True))[0]
    assert len(out.token_ids) == max_tokens
    assert out.finish_reason == "length"
    stats = out.spec_stats
    # The prefill emits token 1; a step may draft at most (remaining - 1) tokens so that the
    # bonus token still fits: max_tokens - 2 in all (none for max_tokens <= 2).
    assert stats.num_draft_tokens <= max(0, max_tokens - 2)
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert stats.num_emitted_tokens <= max_tokens - 1
    for _, num_tokens, num_proposed in proposal_log:
        assert 0 < num_tokens <= max_tokens - 2
        assert num_proposed <= num_tokens
    _assert_stats_consistent(out)


@pytest.mark.parametrize("min_n, max_n", [(0, 2), (3, 1), (0, 0)])
def test_find_continuation_invalid_range_raises(min_n, max_n):
    with pytest.raises(ValueError, match="n-gram range"):
        find_ngram_continuation([1, 2, 1, 2], min_n, max_n, 2)
