"""Property-based fuzzing of the request checks before the engine (issue 23, item 5).

`SamplingParams` and `RequestValidator` are the only gate between a client's values and an
engine step that every running request shares, so they are fuzzed with hypothesis rather
than with a list of cases someone thought of: any value of any type (huge and negative ints,
NaN, infinities, subnormal floats such as 1e-39, bools, strings, None, lists) is either
refused with a ValueError that names a field which is bad on its own, or accepted with every
field in range. What they accept must then be safe downstream: `sample.ops.compute_probs`
gives finite rows summing to 1, the same for a row alone as inside any batch, and the engine
serves accepted requests next to a fixed greedy neighbour without changing its tokens.

Examples are derandomized (the same ones on every run, as CI needs) and bounded in number.
"""

from __future__ import annotations

import math
import re

import pytest

hypothesis = pytest.importorskip("hypothesis")

import torch  # noqa: E402
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specmoe import LLM  # noqa: E402
from specmoe.engine.validation import MIN_TEMPERATURE, RequestValidator  # noqa: E402
from specmoe.sample.ops import SamplingTensors, compute_probs  # noqa: E402
from specmoe.sampling_params import (MAX_SPECULATIVE_TOKENS, MAX_TEMPERATURE,  # noqa: E402
                                     SamplingParams)
from tiny_models import save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The same examples on every run; no example database written into the checkout.
FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

# Floats at the edges of float32 and float64: subnormal in float32 (1e-39), below float32's
# smallest subnormal (1e-46, 5e-324: zero once a tensor holds them), the smallest normal
# float32 (MIN_TEMPERATURE), negative zero, and huge.
EDGE_FLOATS = [1e-39, 1e-46, 5e-324, MIN_TEMPERATURE, -0.0, 1e308, -1e308,
               math.nan, math.inf, -math.inf]
EDGE_INTS = [2**31, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, 10**30, -1]

# Any value a JSON body or a careless caller could hand over.
ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from(EDGE_INTS), st.floats(),
    st.sampled_from(EDGE_FLOATS), st.text(max_size=4), st.binary(max_size=3),
    st.lists(st.one_of(st.integers(), st.floats(), st.text(max_size=2), st.none()),
             max_size=3),
    st.tuples(st.integers()), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))

VOCAB_SIZE = 64  # vocabulary of the validators, logits and model below

# Values SamplingParams accepts, each range's boundaries listed (hypothesis seldom draws a
# bound such as top_k=-1 by itself); a subnormal temperature is one of them, the
# model-dependent RequestValidator refuses it. Small ints are likely, so that the
# model-dependent checks accept some too.
IN_RANGE = {
    "temperature": st.one_of(st.floats(0, MAX_TEMPERATURE), st.integers(0, 3), st.sampled_from(
        [0, 0.0, 1e-39, 1e-46, 5e-324, MIN_TEMPERATURE, MAX_TEMPERATURE])),
    "top_k": st.one_of(st.integers(-1, VOCAB_SIZE + 2), st.sampled_from([-1, 0, 1, 2**31, 2**63])),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), st.sampled_from([1, 1e-39, 5e-324])),
    "min_p": st.one_of(st.floats(0, 1), st.sampled_from([0, 1, 1e-39])),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1), st.sampled_from([0, 2**63 - 1])),
    "max_tokens": st.one_of(st.integers(1, 40), st.sampled_from([1, 2**31, 2**63])),
    "stop": st.one_of(st.none(), st.text(min_size=1, max_size=3),
                      st.lists(st.text(min_size=1, max_size=3), max_size=3),
                      st.tuples(st.text(min_size=1, max_size=2))),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(0, VOCAB_SIZE), max_size=3),
                                st.just([0, VOCAB_SIZE - 1])),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, VOCAB_SIZE + 1),
                          st.sampled_from([0, VOCAB_SIZE])),
    "num_speculative_tokens": st.one_of(st.none(), st.integers(0, MAX_SPECULATIVE_TOKENS),
                                        st.sampled_from([0, MAX_SPECULATIVE_TOKENS])),
}
FIELDS = list(IN_RANGE)
# Just outside each field's range, or its neighbour type (a bool is an int in Python, an
# int is not a list): the boundaries a lax or off-by-one check lets through.
NEAR_MISS = {
    "temperature": [-1e-300, 100.00000000000001, math.nan, math.inf, True, "1"],
    "top_k": [-2, True, 1.0, 2.5],
    "top_p": [0, -0.0, 1.0000000000000002, math.nan, False],
    "min_p": [-1e-300, 1.0000000000000002, -math.inf, True],
    "seed": [-1, 2**63, 2**64, True, 1.0],
    "max_tokens": [0, -1, True, 1.0, 2.0],
    "stop": ["", [""], [1], [None], b"a", {"a": 1}],
    "stop_token_ids": [[-1], [True], [1.0], "1", 1],
    "ignore_eos": [1, 0, "false", None],
    "logprobs": [-1, True, 1.0],
    "num_speculative_tokens": [-1, MAX_SPECULATIVE_TOKENS + 1, True, 1.0],
}


@st.composite
def params_fields(draw, garbage: bool = True) -> dict:
    """Keyword arguments for SamplingParams: any subset of its fields in range, then (with
    `garbage`) up to three fields replaced by a near miss or anything at all, so that a
    refusal usually has a single cause to name."""
    fields = draw(st.fixed_dictionaries({}, optional=IN_RANGE))
    if garbage:
        for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
            fields[name] = draw(st.sampled_from(NEAR_MISS[name]) | ANYTHING)
    return fields


def blamed_field(exc: ValueError) -> str:
    """The field a refusal names: every message starts "invalid <field>"."""
    match = re.match(r"invalid (\w+)", str(exc))
    assert match, f"the message does not name a field: {exc}"
    return match.group(1)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v: object) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def assert_in_range(p: SamplingParams, given: dict) -> None:
    """Every field of accepted params has its documented type and range, and holds what was
    given (only top_k -1 -> 0, a str stop -> [str] and None lists -> [] are rewritten)."""
    assert is_real(p.temperature) and 0 <= p.temperature <= MAX_TEMPERATURE
    assert is_int(p.top_k) and p.top_k >= 0
    assert is_real(p.top_p) and 0 < p.top_p <= 1
    assert is_real(p.min_p) and 0 <= p.min_p <= 1
    assert p.seed is None or (is_int(p.seed) and 0 <= p.seed < 2**63)
    assert is_int(p.max_tokens) and p.max_tokens >= 1
    assert isinstance(p.stop, list) and all(isinstance(s, str) and s for s in p.stop)
    assert isinstance(p.stop_token_ids, list)
    assert all(is_int(t) and t >= 0 for t in p.stop_token_ids)
    assert isinstance(p.ignore_eos, bool)
    assert p.logprobs is None or (is_int(p.logprobs) and p.logprobs >= 0)
    assert p.num_speculative_tokens is None or (
        is_int(p.num_speculative_tokens) and p.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
        and p.num_speculative_tokens >= 0)
    for name in ("temperature", "top_p", "min_p", "seed", "max_tokens", "ignore_eos",
                 "logprobs", "num_speculative_tokens"):
        if name in given:
            assert getattr(p, name) == given[name] and type(getattr(p, name)) is type(
                given[name]), name
    if given.get("top_k", -1) != -1:
        assert p.top_k == given["top_k"]


@settings(FUZZ, max_examples=400)
@given(fields=params_fields())
def test_sampling_params_refuses_by_name_or_holds_every_field_in_range(fields):
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        name = blamed_field(exc)
        event(f"refused: {name}")  # (--hypothesis-show-statistics shows the mix)
        assert name in fields, f"{exc} blames a field that was not given"
        # The blamed value is bad on its own, not because of its neighbours.
        with pytest.raises(ValueError, match=f"^invalid {name}"):
            SamplingParams(**{name: fields[name]})
        return
    event("accepted")
    assert_in_range(params, fields)


@settings(FUZZ, max_examples=300)
@given(name=st.sampled_from(FIELDS), data=st.data())
def test_each_field_alone_is_refused_by_name_or_in_range(name, data):
    """One field at a time, so that every boundary of every field is tried on its own."""
    value = data.draw(st.one_of(st.sampled_from(NEAR_MISS[name]), IN_RANGE[name], ANYTHING),
                      label=name)
    try:
        params = SamplingParams(**{name: value})
    except ValueError as exc:
        assert blamed_field(exc) == name, exc
        return
    assert_in_range(params, {name: value})


@settings(FUZZ, max_examples=300)
@given(fields=params_fields(garbage=False), vocab_size=st.integers(1, VOCAB_SIZE),
       has_tokenizer=st.booleans())
def test_validator_refuses_by_name_or_what_the_model_serves(fields, vocab_size, has_tokenizer):
    try:
        params = SamplingParams(**fields)
    except ValueError:
        return  # the previous test's subject
    validator = RequestValidator(vocab_size, max_model_len=32, has_tokenizer=has_tokenizer)
    try:
        validator.check_params(params)
    except ValueError as exc:
        assert blamed_field(exc) in {"temperature", "logprobs", "stop_token_ids", "stop"}
        assert blamed_field(exc) in fields, exc
        return
    # Accepted: every value is one this model serves.
    assert params.temperature == 0 or params.temperature >= MIN_TEMPERATURE
    assert params.logprobs is None or params.logprobs <= vocab_size
    assert all(t < vocab_size for t in params.stop_token_ids)
    assert has_tokenizer or not params.stop


@settings(FUZZ, max_examples=200)
@given(prompt=st.lists(st.one_of(st.integers(-2, 40), ANYTHING), max_size=40))
def test_validator_accepts_only_prompts_the_model_can_continue(prompt):
    validator = RequestValidator(vocab_size=32, max_model_len=32, has_tokenizer=False)
    try:
        validator.check_prompt(prompt)
    except ValueError as exc:
        assert blamed_field(exc) == "prompt", exc
        return
    assert 0 < len(prompt) < 32 and all(is_int(t) and 0 <= t < 32 for t in prompt)


# ---- what is accepted is safe downstream ------------------------------------------------

# Logit values with ties, float32 extremes and -inf (allowed while one entry per row is finite).
LOGIT = st.one_of(st.floats(-30, 30, width=32),
                  st.sampled_from([0.0, 1.0, -3.0e38, 3.0e38, 1e-40, -math.inf]))


def accepted_params(fields: dict, validator: RequestValidator) -> SamplingParams | None:
    """SamplingParams(**fields) if both checks accept them, else None."""
    try:
        params = SamplingParams(**fields)
        validator.check_params(params)
    except ValueError:
        return None
    return params


@st.composite
def batches(draw) -> tuple[torch.Tensor, list[SamplingParams]]:
    """1-4 rows of accepted params (greedy and sampled mixed) and finite-enough logits."""
    vocab_size = draw(st.integers(1, 48))
    validator = RequestValidator(vocab_size, max_model_len=32, has_tokenizer=True)
    rows = draw(st.lists(params_fields(garbage=False), min_size=1, max_size=4))
    params = [p for p in (accepted_params(f, validator) for f in rows) if p is not None]
    params = params or [SamplingParams()]
    values = draw(st.lists(LOGIT, min_size=len(params) * vocab_size,
                           max_size=len(params) * vocab_size))
    logits = torch.tensor(values, dtype=torch.float32).view(len(params), vocab_size)
    logits[logits.isinf().all(dim=-1), 0] = 0.0  # every row keeps one finite entry
    # bfloat16 has float32's range: the extremes above stay finite in it
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return logits.to(dtype), params


@settings(FUZZ, max_examples=300)
@given(batch=batches())
def test_accepted_params_give_finite_distributions_independent_of_the_batch(batch):
    logits, params = batch
    probs = compute_probs(logits, SamplingTensors.from_params(params))
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    assert torch.isfinite(probs).all() and (probs >= 0).all(), probs
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(params)), rtol=0, atol=1e-5)
    top = logits.float().argmax(dim=-1)  # lowest id among ties, as the sampler's argmax
    for i, p in enumerate(params):
        assert probs[i, top[i]] > 0, "the most likely token is never filtered out"
        if p.is_greedy:
            assert probs[i, top[i]] == 1.0
        elif p.top_k > 0:
            assert int((probs[i] > 0).sum()) <= p.top_k
        # A row's distribution does not depend on the other rows of its batch.
        alone = compute_probs(logits[i:i + 1], SamplingTensors.from_params([p]))
        torch.testing.assert_close(probs[i:i + 1], alone, rtol=0, atol=1e-6)


# ---- the engine serves what is accepted, next to an unaffected neighbour -----------------

NEIGHBOUR_PROMPT = [10, 20, 30, 40, 10, 20, 30]  # repetitive: the n-gram proposer drafts
NEIGHBOUR = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    """A random 1-layer Llama (vocabulary 64, context 32, no tokenizer) with n-gram
    speculation (K=3), so fuzzed params also go through draft verification."""
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_fuzz"), vocab_size=VOCAB_SIZE,
                           max_position_embeddings=32)
    return LLM(str(path), dtype="float32",
               speculative={"method": "ngram", "num_speculative_tokens": 3})


def test_engine_serves_accepted_fuzzed_params_without_touching_a_neighbour(llm):
    reference = llm.generate([NEIGHBOUR_PROMPT], NEIGHBOUR)[0].token_ids
    kv_cache = llm.engine.scheduler.kv_cache

    @settings(FUZZ, max_examples=40)
    # Values in range: refused ones never reach the engine, so garbage adds nothing here.
    @given(rows=st.lists(params_fields(garbage=False), min_size=3, max_size=3),
           prompts=st.lists(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=8),
                            min_size=3, max_size=3))
    def check(rows, prompts):
        served = [(prompt, p) for prompt, p in zip(prompts, (
            accepted_params(f, llm.validator) for f in rows)) if p is not None]
        event(f"{len(served)} fuzzed requests served")
        outputs = llm.generate([NEIGHBOUR_PROMPT] + [prompt for prompt, _ in served],
                               [NEIGHBOUR] + [p for _, p in served])
        assert outputs[0].token_ids == reference
        for out, (prompt, p) in zip(outputs[1:], served):
            assert 1 <= len(out.token_ids) <= p.max_tokens
            assert len(prompt) + len(out.token_ids) <= llm.max_model_len
            assert all(0 <= t < VOCAB_SIZE for t in out.token_ids)
        assert kv_cache.num_free_blocks == kv_cache.num_blocks
    check()
