"""Tests for specmoe.sample.ops: probability processing, logprobs, random draws, sampling."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from specmoe.sample.ops import (SamplingTensors, compute_logprobs, compute_probs,
                                draw_exponentials, draw_random, exponential_race,
                                sample_from_probs)
from specmoe.sampling_params import SamplingParams

# Significance level of every chi-square goodness-of-fit test in this file. Generators are
# seeded, so each test is deterministic; the level says how unlikely a pass-by-luck failure is.
ALPHA = 1e-3

BASE_PROBS = [0.1, 0.2, 0.3, 0.4]


def _st(*params: SamplingParams) -> SamplingTensors:
    return SamplingTensors.from_params(list(params), "cpu")


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()[None, :]  # [1, vocab_size]


def _assert_probs(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor([expected], dtype=torch.float32),
                               atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- SamplingTensors


def test_from_params_values_and_flags():
    st = _st(SamplingParams(temperature=0.7, top_k=-1, top_p=0.9),
             SamplingParams(temperature=0.0, top_k=5, min_p=0.2))
    assert st.temperature.dtype == torch.float32 and st.top_k.dtype == torch.int64
    assert st.temperature.tolist() == pytest.approx([0.7, 0.0])
    assert st.top_k.tolist() == [0, 5]
    assert st.top_p.tolist() == pytest.approx([0.9, 1.0])
    assert st.min_p.tolist() == pytest.approx([0.0, 0.2])
    assert st.is_greedy.tolist() == [False, True]
    # The greedy row's filters never apply, so they do not switch flags on.
    assert (st.all_greedy, st.any_top_k, st.any_top_p, st.any_min_p) == (False, False, True,
                                                                         False)
    assert _st(SamplingParams(temperature=0.0)).all_greedy


def test_repeat_rows_and_index_select():
    st = _st(SamplingParams(temperature=0.5), SamplingParams(temperature=0.0, top_k=3),
             SamplingParams(top_p=0.8))
    rep = st.repeat_rows([2, 0, 3])
    assert rep.temperature.tolist() == pytest.approx([0.5, 0.5, 1.0, 1.0, 1.0])
    assert rep.top_p.tolist() == pytest.approx([1.0, 1.0, 0.8, 0.8, 0.8])
    assert st.repeat_rows(2).top_k.tolist() == [0, 0, 3, 3, 0, 0]
    sel = st.index_select(torch.tensor([2, 0]))
    assert sel.temperature.tolist() == pytest.approx([1.0, 0.5])
    assert sel.num_rows == 2 and sel.any_top_p == st.any_top_p


@pytest.mark.parametrize("counts", [[1, 2], [1, -1, 1], -1])
def test_repeat_rows_rejects_bad_counts(counts):
    st = _st(SamplingParams(), SamplingParams(), SamplingParams())
    with pytest.raises(ValueError, match="counts"):
        st.repeat_rows(counts)


# ---------------------------------------------------------------- compute_probs


def test_temperature_one_is_softmax():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    st = _st(*[SamplingParams()] * 3)
    torch.testing.assert_close(compute_probs(logits, st), logits.softmax(-1))


def test_temperature_scaling():
    # logits log([1, 2, 4]) / 2 -> probs proportional to [1, sqrt(2), 2].
    probs = compute_probs(_logits([1.0, 2.0, 4.0]), _st(SamplingParams(temperature=2.0)))
    weights = [1.0, math.sqrt(2.0), 2.0]
    _assert_probs(probs, [w / sum(weights) for w in weights])


@pytest.mark.parametrize("top_k, expected", [
    (1, [0, 0, 0, 1]),
    (2, [0, 0, 3 / 7, 4 / 7]),
    (3, [0, 2 / 9, 3 / 9, 4 / 9]),
    (4, BASE_PROBS),
    (100, BASE_PROBS),  # larger than the vocabulary: no-op
])
def test_top_k(top_k, expected):
    _assert_probs(compute_probs(_logits(BASE_PROBS), _st(SamplingParams(top_k=top_k))),
                  expected)


@pytest.mark.parametrize("top_p, expected", [
    (0.01, [0, 0, 0, 1]),  # the top token is always kept
    (0.3, [0, 0, 0, 1]),  # 0.4 >= 0.3
    (0.65, [0, 0, 3 / 7, 4 / 7]),  # 0.4 < 0.65 <= 0.4 + 0.3
    (0.71, [0, 2 / 9, 3 / 9, 4 / 9]),  # 0.7 < 0.71 <= 0.9
    (0.95, BASE_PROBS),
    (1.0, BASE_PROBS),
])
def test_top_p(top_p, expected):
    _assert_probs(compute_probs(_logits(BASE_PROBS), _st(SamplingParams(top_p=top_p))),
                  expected)


@pytest.mark.parametrize("min_p, expected", [
    (0.0, BASE_PROBS),
    (0.2, BASE_PROBS),  # threshold 0.08
    (0.45, [0, 2 / 9, 3 / 9, 4 / 9]),  # threshold 0.18
    (0.6, [0, 0, 3 / 7, 4 / 7]),  # threshold 0.24
    (1.0, [0, 0, 0, 1]),
])
def test_min_p(min_p, expected):
    _assert_probs(compute_probs(_logits(BASE_PROBS), _st(SamplingParams(min_p=min_p))),
                  expected)


def test_temperature_applies_before_top_p():
    # T=0.5 squares the probabilities: [1, 4, 9, 16] / 30. Top-p 0.8 keeps {16/30, 9/30}
    # (cumulative 0.83); without temperature first it would keep three tokens (0.4+0.3 < 0.8).
    probs = compute_probs(_logits(BASE_PROBS), _st(SamplingParams(temperature=0.5, top_p=0.8)))
    _assert_probs(probs, [0, 0, 9 / 25, 16 / 25])


def test_filters_are_per_row():
    logits = _logits(BASE_PROBS).expand(5, 4)
    st = _st(SamplingParams(top_k=2), SamplingParams(top_p=0.71), SamplingParams(min_p=0.6),
             SamplingParams(), SamplingParams(top_k=3, min_p=0.6))
    expected = torch.tensor([[0, 0, 3 / 7, 4 / 7], [0, 2 / 9, 3 / 9, 4 / 9],
                             [0, 0, 3 / 7, 4 / 7], BASE_PROBS, [0, 0, 3 / 7, 4 / 7]])
    torch.testing.assert_close(compute_probs(logits, st), expected, atol=1e-6, rtol=1e-5)


def test_conservative_flags_with_disabled_values_are_no_ops():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    st = _st(*[SamplingParams(temperature=0.8)] * 4)
    forced = SamplingTensors(st.temperature, st.top_k, st.top_p, st.min_p, all_greedy=False,
                             any_top_k=True, any_top_p=True, any_min_p=True)
    torch.testing.assert_close(compute_probs(logits, forced), compute_probs(logits, st))


def test_greedy_rows_are_one_hot_at_lowest_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0],  # tie: lowest id wins
                           [5.0, 1.0, 2.0, -1.0],
                           [0.1, 0.2, 0.3, 0.4]])
    st = _st(SamplingParams(temperature=0.0, top_k=1), SamplingParams(temperature=0.0),
             SamplingParams(temperature=1.0))
    probs = compute_probs(logits, st)
    assert probs[0].tolist() == [0, 1, 0, 0] and probs[1].tolist() == [1, 0, 0, 0]
    torch.testing.assert_close(probs[2], logits[2].softmax(-1))
    all_greedy = compute_probs(logits[:2], st.index_select(torch.tensor([0, 1])))
    assert all_greedy.tolist() == probs[:2].tolist() and all_greedy.dtype == torch.float32


def test_neg_inf_logits_and_low_precision_input():
    logits = torch.tensor([[float("-inf"), 0.0, 0.0, float("-inf")]], dtype=torch.bfloat16)
    probs = compute_probs(logits, _st(SamplingParams(top_p=0.9, top_k=3)))
    assert probs.dtype == torch.float32
    _assert_probs(probs, [0, 0.5, 0.5, 0])


def test_compute_probs_rejects_bad_shape():
    with pytest.raises(ValueError, match="num_rows=2"):
        compute_probs(torch.zeros(3, 4), _st(SamplingParams(), SamplingParams()))
    with pytest.raises(ValueError, match="num_rows"):
        compute_probs(torch.zeros(4), _st(SamplingParams()))


# ---------------------------------------------------------------- compute_logprobs


def test_compute_logprobs_matches_log_softmax():
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    token_ids = torch.tensor([0, 3, 11, 7, 7])
    token_lp, top_ids, top_lp = compute_logprobs(logits, token_ids, 3)
    reference = logits.float().log_softmax(-1)
    torch.testing.assert_close(token_lp, reference[torch.arange(5), token_ids])
    assert top_ids.dtype == torch.int64 and top_lp.dtype == torch.float32
    assert top_ids.shape == top_lp.shape == (5, 3)
    torch.testing.assert_close(top_lp, reference.sort(-1, descending=True).values[:, :3])
    torch.testing.assert_close(top_lp, reference.gather(1, top_ids))
    _, none_ids, none_lp = compute_logprobs(logits, token_ids, 0)
    assert none_ids.shape == none_lp.shape == (5, 0)


def test_compute_logprobs_rejects_bad_input():
    with pytest.raises(ValueError, match="num_top"):
        compute_logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="token_ids"):
        compute_logprobs(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), 1)


# ---------------------------------------------------------------- random draws and sampling


def test_draw_random_order_per_generator():
    # Rows 0 and 2 share generator A: drawn as one block (uniforms [2, 3], then exponentials
    # [2, 2, 5]); row 1 with its own generator draws uniforms [3], then exponentials [2, 5].
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
    draws = draw_random([gen_a, gen_b, gen_a], 3, (2, 5), "cpu")
    assert draws.uniforms.shape == (3, 3) and draws.exponentials.shape == (3, 2, 5)
    ref_a, ref_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
    u_a = torch.rand((2, 3), generator=ref_a)
    e_a = torch.empty(2, 2, 5).exponential_(generator=ref_a)
    u_b = torch.rand(3, generator=ref_b)
    e_b = torch.empty(2, 5).exponential_(generator=ref_b)
    assert torch.equal(draws.uniforms[[0, 2]], u_a) and torch.equal(draws.uniforms[1], u_b)
    assert torch.equal(draws.exponentials[[0, 2]], e_a)
    assert torch.equal(draws.exponentials[1], e_b)
    assert bool((draws.exponentials > 0).all())


def test_draw_exponentials_uses_default_generator_for_none():
    torch.manual_seed(123)
    first = draw_exponentials([None, None], (4,), "cpu")
    torch.manual_seed(123)
    assert torch.equal(first, draw_exponentials([None, None], (4,), "cpu"))


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness-of-fit p-value; zero-probability cells must be empty (else 0.0)."""
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    keep = probs > 0
    expected = counts.sum() * probs[keep] / probs[keep].sum()
    assert expected.min() >= 5, "too few samples for the chi-square approximation"
    return float(stats.chisquare(counts[keep].numpy(), expected.numpy()).pvalue)


def test_sample_from_probs_matches_distribution():
    probs = torch.tensor([0.05, 0.0, 0.25, 0.1, 0.3, 0.02, 0.08, 0.2])
    num_samples = 40_000
    generator = torch.Generator().manual_seed(11)
    tokens = sample_from_probs(probs.expand(num_samples, -1), [generator] * num_samples)
    assert tokens.dtype == torch.int64 and tokens.shape == (num_samples,)
    counts = torch.bincount(tokens, minlength=8)
    assert counts[1] == 0
    assert _chi_square_p_value(counts, probs) > ALPHA
    # A wrong distribution is rejected by the same check (the test can fail).
    assert _chi_square_p_value(counts, probs.roll(1).clamp_min(0.01)) < ALPHA


def test_exponential_race_accepts_unnormalised_probs():
    probs = torch.tensor([[0.0, 2.0, 6.0]]).expand(30_000, -1)
    exponentials = draw_exponentials([torch.Generator().manual_seed(3)] * 30_000, (3,), "cpu")
    counts = torch.bincount(exponential_race(probs, exponentials), minlength=3)
    assert _chi_square_p_value(counts, torch.tensor([0.0, 0.25, 0.75])) > ALPHA


def test_sample_from_probs_per_row_generators_are_reproducible():
    probs = torch.rand(4, 50, generator=torch.Generator().manual_seed(5))

    def run(seeds: list[int]) -> torch.Tensor:
        return sample_from_probs(probs[:len(seeds)],
                                 [torch.Generator().manual_seed(s) for s in seeds])

    assert torch.equal(run([1, 2, 3, 4]), run([1, 2, 3, 4]))
    alone = sample_from_probs(probs[2:3], [torch.Generator().manual_seed(3)])
    assert alone.item() == run([1, 2, 3, 4])[2].item()


def test_sample_from_probs_rejects_bad_input():
    with pytest.raises(ValueError, match="generator"):
        sample_from_probs(torch.ones(3, 4), [None, None])
    with pytest.raises(ValueError, match="num_rows"):
        sample_from_probs(torch.ones(4), [None])


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 1e-8])
def test_tiny_temperature_is_the_greedy_limit_not_nan(temperature):
    """logits / 1e-39 alone overflow to inf and softmax gives NaN (issue 23, D2)."""
    logits = torch.tensor([[5.0, 3.0, 1.0, 0.0], [2.0, 7.0, 7.0, -1.0]])
    probs = compute_probs(logits, _st(*[SamplingParams(temperature=temperature)] * 2))
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0],
                                                    [0.0, 0.5, 0.5, 0.0]]))


@pytest.mark.parametrize("top_k", [2**63, 2**31, 10**30])
def test_top_k_past_int64_keeps_every_token(top_k):
    """A top_k of 2**63 or more overflowed int64 and failed the whole step (issue 23, D1)."""
    probs = compute_probs(_logits(BASE_PROBS), _st(SamplingParams(top_k=top_k)))
    _assert_probs(probs, BASE_PROBS)
