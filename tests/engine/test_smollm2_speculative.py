"""End to end on the real SmolLM2-135M (GGUF, fp32): speculation is lossless.

Greedy output with speculation (n-gram K=4; the same model as its own draft, K=3) equals
greedy output without it token for token, with the same logprobs; a model drafting for itself
has every draft accepted; spec stats add up; seeded sampling reproduces; stop strings cut the
text under speculation. Prompts are real Spec-Bench questions wrapped in the chat template.
"""

from __future__ import annotations


import pytest

from specmoe import LLM, SamplingParams
from specmoe.utils.data import one_per_category

CATEGORIES = ("writing", "math", "coding", "translation", "qa")  # short prompts, one each
MAX_TOKENS = 48
NGRAM_K = 4
DRAFT_K = 3
LOGPROB_TOL = 1e-4
# It loads the real model (four times: three engines, one draft), through fixtures the tests
# reach by name, which the conftest's slow marking does not see.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def questions() -> list[str]:
    prompts = one_per_category("spec_bench", list(CATEGORIES))
    assert [p.category for p in prompts] == list(CATEGORIES)
    return [p.text for p in prompts]


@pytest.fixture(scope="module")
def plain_llm(smollm2) -> LLM:
    return LLM("smollm2-135m", dtype="float32")


@pytest.fixture(scope="module")
def ngram_llm(smollm2) -> LLM:
    return LLM("smollm2-135m", dtype="float32",
               speculative={"method": "ngram", "num_speculative_tokens": NGRAM_K,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3})


@pytest.fixture(scope="module")
def draft_llm(smollm2) -> LLM:
    return LLM("smollm2-135m", dtype="float32",
               speculative={"method": "draft", "draft_model": "smollm2-135m",
                            "num_speculative_tokens": DRAFT_K})


@pytest.fixture(scope="module")
def prompts(plain_llm, questions) -> list[str]:
    return [plain_llm.chat_prompt([{"role": "user", "content": q}]) for q in questions]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=False, logprobs=2)


@pytest.fixture(scope="module")
def plain_out(plain_llm, prompts):
    return plain_llm.generate(prompts, GREEDY)


@pytest.fixture(scope="module")
def ngram_out(ngram_llm, prompts):
    return ngram_llm.generate(prompts, GREEDY)


@pytest.fixture(scope="module")
def draft_out(draft_llm, prompts):
    return draft_llm.generate(prompts, GREEDY)


@pytest.fixture(params=["ngram", "draft"])
def method(request) -> str:
    return request.param


@pytest.fixture
def spec_llm(method, request) -> LLM:
    return request.getfixturevalue(f"{method}_llm")


@pytest.fixture
def spec_out(method, request):
    return request.getfixturevalue(f"{method}_out")


# ------------------------------------------------------------------ greedy losslessness


def test_prompts_are_real_chat_prompts(prompts, plain_out):
    assert len(prompts) >= 5
    assert all(p.startswith("<|im_start|>") and p.endswith("assistant\n") for p in prompts)
    assert all(out.token_ids for out in plain_out)


def test_greedy_identical_with_and_without_speculation(plain_out, spec_out, method):
    for plain, spec in zip(plain_out, spec_out, strict=True):
        assert spec.token_ids == plain.token_ids, spec.prompt
        assert spec.text == plain.text
        assert spec.finish_reason == plain.finish_reason
        assert spec.stop_reason == plain.stop_reason
        assert len(spec.token_ids) <= MAX_TOKENS
    assert sum(out.spec_stats.num_drafts for out in spec_out) > 0, "nothing was drafted"
    assert sum(out.spec_stats.num_accepted_tokens for out in spec_out) > 0


def test_greedy_logprobs_equal_without_speculation(plain_out, spec_out):
    for plain, spec in zip(plain_out, spec_out, strict=True):
        assert spec.token_ids == plain.token_ids
        assert len(spec.logprobs) == len(plain.logprobs) == len(plain.token_ids)
        for token, p, s in zip(plain.token_ids, plain.logprobs, spec.logprobs):
            assert p.token_id == s.token_id == token
            assert s.logprob == pytest.approx(p.logprob, abs=LOGPROB_TOL)
            assert len(s.top_logprobs) == len(p.top_logprobs) == 2
            assert s.top_logprobs[0][0] == p.top_logprobs[0][0] == token  # greedy: argmax
            for (p_id, p_lp), (s_id, s_lp) in zip(p.top_logprobs, s.top_logprobs):
                assert s_lp == pytest.approx(p_lp, abs=LOGPROB_TOL)
                if abs(p.top_logprobs[0][1] - p.top_logprobs[1][1]) > LOGPROB_TOL:
                    assert s_id == p_id


def test_plain_run_has_no_spec_stats(plain_out):
    for out in plain_out:
        assert out.spec_stats.num_drafts == 0
        assert out.spec_stats.num_draft_tokens == 0
        assert out.spec_stats.mean_acceptance_length == 1.0


def test_same_model_as_draft_accepts_every_draft(draft_out):
    for out in draft_out:
        stats = out.spec_stats
        assert stats.num_drafts > 0 or len(out.token_ids) <= 2
        if out.finish_reason == "length":
            assert stats.acceptance_rate == 1.0, stats.to_dict()
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        else:
            # Only the block that reached EOS may be cut: its drafts after EOS are not kept.
            assert stats.num_draft_tokens - stats.num_accepted_tokens <= DRAFT_K - 1
        # Every step before the last emits K + 1 tokens (or stops at max_tokens).
        assert stats.num_drafts <= -(-(len(out.token_ids) - 1) // (DRAFT_K + 1)) + 1


def test_spec_stats_are_consistent(spec_out, method):
    k = NGRAM_K if method == "ngram" else DRAFT_K
    for out in spec_out:
        stats = out.spec_stats
        assert stats.num_accepted_tokens <= stats.num_draft_tokens <= k * stats.num_drafts
        if stats.num_drafts:
            assert stats.mean_acceptance_length == pytest.approx(
                1 + stats.num_accepted_tokens / stats.num_drafts)
        per_position = stats.num_accepted_per_position
        assert len(per_position) <= k
        assert all(a >= b for a, b in zip(per_position, per_position[1:])), per_position
        assert sum(per_position) == stats.num_accepted_tokens
        assert not per_position or per_position[0] <= stats.num_drafts
        assert stats.num_accepted_tokens <= stats.num_emitted_tokens
        assert stats.num_emitted_tokens <= stats.num_accepted_tokens + stats.num_drafts
        assert stats.num_emitted_tokens <= len(out.token_ids) - 1  # not the prefill token
        rates = stats.acceptance_per_position()
        assert all(0.0 <= r <= 1.0 for r in rates)
        assert stats.to_dict()["acceptance_rate"] == stats.acceptance_rate


# ------------------------------------------------------------------ sampling


def test_seeded_sampling_reproducible_with_speculation(spec_llm, prompts):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    first = spec_llm.generate(prompts[:2], params)
    second = spec_llm.generate(prompts[:2], params)
    for a, b in zip(first, second, strict=True):
        assert len(a.token_ids) == 16
        assert a.token_ids == b.token_ids
        assert a.text == b.text
        assert a.spec_stats.num_draft_tokens == b.spec_stats.num_draft_tokens
        assert a.spec_stats.num_accepted_tokens == b.spec_stats.num_accepted_tokens
    assert sum(out.spec_stats.num_drafts for out in first) > 0


# ------------------------------------------------------------------ stop strings


def _pick_stop_string(tokenizer, out, spanning: bool) -> tuple[str, int] | None:
    """A stop string first completed by token j of a greedy output, and j.

    spanning=False: the (stripped) text of token j, a word of >= 3 letters.
    spanning=True: the last 2 characters before token j plus its first 2, so the stop string
    starts in an earlier token.
    """
    ids = out.token_ids
    for j in range(len(ids) // 3, len(ids) - 1):
        before = tokenizer.decode(ids[:j], skip_special_tokens=True)
        through = tokenizer.decode(ids[:j + 1], skip_special_tokens=True)
        piece = through[len(before):]
        if not through.startswith(before) or len(piece) < 3 or "\ufffd" in through:
            continue
        stop = (before[-2:] + piece[:2]) if spanning else piece.strip()
        if len(stop) < 3 or (not spanning and not stop.isalpha()) or len(before) < 2:
            continue
        if stop not in before and stop in through:
            return stop, j
    return None


def test_stop_strings_under_speculation(spec_llm, prompts, plain_out):
    """Prompts alternate between a one-token word and a stop string spanning two tokens."""
    tokenizer = spec_llm.tokenizer
    checked = []
    for i, (prompt, plain) in enumerate(zip(prompts, plain_out)):
        spanning = i % 2 == 1
        found = _pick_stop_string(tokenizer, plain, spanning)
        if found is None:
            continue
        stop, j = found
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop])
        out = spec_llm.generate(prompt, params)[0]
        full = tokenizer.decode(plain.token_ids[:j + 1], skip_special_tokens=True)
        assert stop not in out.text
        assert out.text == full[:full.find(stop)]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == plain.token_ids[:j + 1]  # ends at the completing token
        checked.append(spanning)
    assert len(checked) >= 3 and any(checked) and not all(checked)
