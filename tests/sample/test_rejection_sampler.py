"""Tests for specmoe.sample.rejection_sampler: losslessness (statistical), greedy exactness,
seeded reproducibility and input validation.

Losslessness (Leviathan et al., 2023, arXiv 2211.17192, Appendix A.1): for every position i,
conditional on the first i emitted tokens being the drafts x_1..x_i (all accepted), the token
emitted at position i is distributed as the target distribution p_i(. | prefix). We check it
with a Pearson chi-square goodness-of-fit test at significance level ALPHA, summing the
statistic over groups of rows that share one target distribution, plus a bound on the total
variation distance between the empirical and the expected distribution. All generators are
seeded, so the tests are deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from scipy import stats

from specmoe.sample.ops import (SamplingTensors, compute_probs, draw_random,
                                exponential_race)
from specmoe.sample.rejection_sampler import RejectionOutput, rejection_sample
from specmoe.sampling_params import SamplingParams

ALPHA = 1e-3  # significance level of every chi-square test in this file
VOCAB_SIZE = 8
NUM_CONTEXTS = 2  # p_i and q_i depend on the previous draft token through token % 2
NUM_TRIALS = 40_000  # rows of one batched call; each row is one independent trial

Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, SamplingTensors,
                    list[torch.Generator | None]], RejectionOutput]


# ---------------------------------------------------------------- statistical harness


@dataclass
class Case:
    target_logits: torch.Tensor  # [num_trials, K + 1, V]
    draft_token_ids: torch.Tensor  # [num_trials, K]
    draft_probs: torch.Tensor | None  # [num_trials, K, V]
    sampling: SamplingTensors
    expected_probs: torch.Tensor  # [num_trials, K + 1, V] float64, the target p per row
    contexts: torch.Tensor  # [num_trials, K + 1] int64: p_i of a row is a function of this


def _dirichlet(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    gamma = -torch.rand(shape, generator=generator, dtype=torch.float64).log()
    return gamma / gamma.sum(-1, keepdim=True)


def _sample_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One inverse-CDF sample per row of probs [num_rows, V] (test-side, independent of the
    code under test)."""
    uniforms = torch.rand(probs.shape[0], 1, generator=generator, dtype=probs.dtype)
    return (probs.cumsum(-1) < uniforms).sum(-1).clamp(max=probs.shape[1] - 1)


def _make_case(num_draft: int, has_draft_probs: bool, seed: int,
               params: SamplingParams | None = None) -> Case:
    """Random position- and context-dependent targets p and drafts, one trial per row.

    p_i(. | prefix) = P[i, prev % 2] with prev the previous draft token (token 0 before the
    first), each peaked on a favourite token. With draft probs, x_i ~ q_i = Q[i, prev % 2], a
    mix of p_i and noise (an autoregressive draft model). Without, x_i is the favourite token of
    p_i with probability 0.8 and uniform otherwise (a deterministic proposer whose choice
    varies across trials, independently of the sampler's randomness).
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (num_draft + 1, NUM_CONTEXTS, VOCAB_SIZE)
    favourite = torch.randint(VOCAB_SIZE, shape[:2], generator=gen)
    one_hot = torch.nn.functional.one_hot(favourite, VOCAB_SIZE).double()
    target_table = 0.5 * one_hot + 0.4 * _dirichlet(shape, gen) + 0.1 / VOCAB_SIZE
    draft_table = 0.5 * target_table[:num_draft] + 0.5 * _dirichlet(shape, gen)[:num_draft]
    drafts = torch.zeros(NUM_TRIALS, num_draft, dtype=torch.int64)
    contexts = torch.zeros(NUM_TRIALS, num_draft + 1, dtype=torch.int64)
    draft_probs = torch.zeros(NUM_TRIALS, num_draft, VOCAB_SIZE, dtype=torch.float64)
    for i in range(num_draft):
        draft_probs[:, i] = draft_table[i, contexts[:, i]]
        if has_draft_probs:
            drafts[:, i] = _sample_rows(draft_probs[:, i], gen)
        else:
            random_token = torch.randint(VOCAB_SIZE, (NUM_TRIALS,), generator=gen)
            is_favourite = torch.rand(NUM_TRIALS, generator=gen) < 0.8
            drafts[:, i] = torch.where(is_favourite, favourite[i, contexts[:, i]],
                                       random_token)
        contexts[:, i + 1] = drafts[:, i] % NUM_CONTEXTS
    positions = torch.arange(num_draft + 1)
    target_probs = target_table[positions, contexts]  # [num_trials, K + 1, V]
    target_logits = target_probs.log().float()
    sampling = SamplingTensors.from_params([params or SamplingParams()] * NUM_TRIALS, "cpu")
    expected = compute_probs(target_logits.reshape(-1, VOCAB_SIZE),
                             sampling.repeat_rows(num_draft + 1)).double()
    return Case(target_logits, drafts, draft_probs.float() if has_draft_probs else None,
                sampling, expected.view(NUM_TRIALS, num_draft + 1, VOCAB_SIZE), contexts)


def _run(case: Case, sampler: Sampler, seed: int) -> RejectionOutput:
    generator = torch.Generator().manual_seed(seed)
    return sampler(case.target_logits, case.draft_token_ids, case.draft_probs, case.sampling,
                   [generator] * NUM_TRIALS)


@dataclass
class Fit:
    p_value: float
    tv_distance: float
    tv_bound: float
    num_rows: int

    @property
    def ok(self) -> bool:
        return self.p_value > ALPHA and self.tv_distance < self.tv_bound


def _conditional_fit(case: Case, output: torch.Tensor, position: int) -> Fit:
    """Goodness of fit of the token at `position`, given that the first `position` emitted
    tokens equal the drafts and a token was emitted there. Rows are grouped by context (their
    target distribution is the same within a group); within a group, cells with expected count
    below 5 are pooled; the chi-square statistic and degrees of freedom are summed over groups.
    A token emitted with target probability 0 gives p-value 0."""
    is_prefix_accepted = (output[:, :position] == case.draft_token_ids[:, :position]).all(1)
    is_eligible = is_prefix_accepted & (output[:, position] >= 0)
    tokens = output[is_eligible, position]  # [num_rows]
    expected = case.expected_probs[is_eligible, position]  # [num_rows, V]
    contexts = case.contexts[is_eligible, position]  # [num_rows]
    statistic, dof = 0.0, 0
    for context in range(NUM_CONTEXTS):
        in_group = contexts == context
        if not bool(in_group.any()):
            continue
        probs = expected[in_group][0]
        assert bool((expected[in_group] == probs).all()), "rows of a group must share p"
        counts = torch.bincount(tokens[in_group], minlength=VOCAB_SIZE).double()
        if counts[probs == 0].sum() > 0:
            return Fit(0.0, 1.0, 0.0, len(tokens))
        group_statistic, group_dof = _pooled_chi_square(counts, counts.sum() * probs)
        statistic, dof = statistic + group_statistic, dof + group_dof
    empirical = torch.bincount(tokens, minlength=VOCAB_SIZE).double() / len(tokens)
    tv_distance = 0.5 * float((empirical - expected.mean(0)).abs().sum())
    # E[TV] <= 0.5 * sum_v sqrt(2 p_v / (pi n)) <= 0.5 * sqrt(2 V / (pi n)) = 0.4 sqrt(V / n);
    # the bound allows 2.5x that worst case.
    tv_bound = math.sqrt(VOCAB_SIZE / len(tokens))
    assert dof > 0, "too few rows for a chi-square test"
    return Fit(float(stats.chi2.sf(statistic, dof)), tv_distance, tv_bound, len(tokens))


def _pooled_chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom over bins of expected count >= 5, built by
    pooling cells of positive expected count in increasing order of expectation."""
    bins: list[list[float]] = []  # [observed, expected]
    for cell in expected.argsort().tolist():
        if expected[cell] == 0:
            continue
        if not bins or bins[-1][1] >= 5:
            bins.append([0.0, 0.0])
        bins[-1][0] += float(counts[cell])
        bins[-1][1] += float(expected[cell])
    if len(bins) > 1 and bins[-1][1] < 5:  # an incomplete last bin joins the previous one
        observed, expect = bins.pop()
        bins[-1][0] += observed
        bins[-1][1] += expect
    if not bins or bins[0][1] < 5:
        return 0.0, 0
    return sum((o - e) ** 2 / e for o, e in bins), len(bins) - 1


def _fits(case: Case, sampler: Sampler, seed: int) -> list[Fit]:
    output = _run(case, sampler, seed).output_token_ids
    return [_conditional_fit(case, output, i) for i in range(case.draft_token_ids.shape[1] + 1)]


# ---------------------------------------------------------------- losslessness


@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["draft_probs", "deterministic"])
@pytest.mark.parametrize("num_draft", [0, 1, 2, 3, 4])
def test_output_is_distributed_as_target(num_draft, has_draft_probs):
    case = _make_case(num_draft, has_draft_probs, seed=100 + num_draft)
    for position, fit in enumerate(_fits(case, rejection_sample, seed=7)):
        assert fit.ok, f"position {position}: {fit}"


def test_output_is_distributed_as_filtered_target():
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05)
    case = _make_case(2, True, seed=5, params=params)
    assert bool((case.expected_probs == 0).any())  # the filters removed some tokens
    for position, fit in enumerate(_fits(case, rejection_sample, seed=8)):
        assert fit.ok, f"position {position}: {fit}"


def _always_accept(target_logits, draft_token_ids, draft_probs, sampling, generators):
    """WRONG on purpose: accepts every draft, then samples the bonus token from p_K."""
    batch_size, num_positions, _ = target_logits.shape
    probs = compute_probs(target_logits[:, -1], sampling)
    bonus = exponential_race(probs, draw_random(generators, 0, probs.shape[1:], "cpu")
                             .exponentials)
    num_accepted = torch.full((batch_size,), num_positions - 1)
    return RejectionOutput(torch.cat([draft_token_ids, bonus[:, None]], 1), num_accepted)


def _resample_from_target(target_logits, draft_token_ids, draft_probs, sampling, generators):
    """WRONG on purpose: correct acceptance test, but a rejected position resamples from p_i
    instead of norm(max(0, p_i - q_i)) (a classic bug)."""
    batch_size, num_positions, vocab_size = target_logits.shape
    num_draft = num_positions - 1
    probs = compute_probs(target_logits.reshape(-1, vocab_size),
                          sampling.repeat_rows(num_positions)).view(target_logits.shape)
    draws = draw_random(generators, num_draft, (num_positions, vocab_size), "cpu")
    index = draft_token_ids[..., None]
    target_p = probs[:, :num_draft].gather(2, index).squeeze(2)
    draft_q = draft_probs.gather(2, index).squeeze(2)
    num_accepted = (draws.uniforms * draft_q < target_p).long().cumprod(1).sum(1)
    tokens = exponential_race(probs, draws.exponentials)  # [batch_size, K + 1]
    positions = torch.arange(num_positions)
    padded = torch.cat([draft_token_ids, torch.full((batch_size, 1), -1)], 1)
    out = torch.where(positions < num_accepted[:, None], padded, -1)
    out = torch.where(positions == num_accepted[:, None], tokens, out)
    return RejectionOutput(out, num_accepted)


@pytest.mark.parametrize("wrong_sampler, has_draft_probs", [
    (_always_accept, True), (_always_accept, False), (_resample_from_target, True)])
def test_check_detects_wrong_samplers(wrong_sampler, has_draft_probs):
    """The harness can fail: deliberately wrong samplers fail the same goodness-of-fit check
    that rejection_sample passes on the same inputs."""
    case = _make_case(2, has_draft_probs, seed=102)
    assert all(fit.ok for fit in _fits(case, rejection_sample, seed=7))
    wrong = _fits(case, wrong_sampler, seed=7)
    assert any(fit.p_value < ALPHA for fit in wrong), wrong
    assert any(fit.tv_distance >= fit.tv_bound for fit in wrong), wrong


def test_output_layout_invariants():
    case = _make_case(3, True, seed=9)
    result = _run(case, rejection_sample, seed=1)
    out, num_accepted = result.output_token_ids, result.num_accepted
    assert out.dtype == num_accepted.dtype == torch.int64 and out.shape == (NUM_TRIALS, 4)
    positions = torch.arange(4)
    n = num_accepted[:, None]
    padded_drafts = torch.cat([case.draft_token_ids, torch.full((NUM_TRIALS, 1), -1)], 1)
    assert bool((out[positions < n] == padded_drafts[positions < n]).all())
    assert bool((out.gather(1, n) >= 0).all())
    assert bool((out[positions > n] == -1).all())
    # A recovered token never equals the rejected draft (the residual is 0 there).
    rejected = num_accepted < 3
    recovered = out[rejected].gather(1, n[rejected]).squeeze(1)
    assert bool((recovered != case.draft_token_ids[rejected].gather(1, n[rejected])
                 .squeeze(1)).all())
    assert 0 < num_accepted.float().mean() < 3  # both outcomes happen


# ---------------------------------------------------------------- greedy


def _greedy_case(num_draft: int, mismatch_at: list[int], vocab_size: int = 20):
    """Random logits; row b's drafts follow the target argmax up to mismatch_at[b] (== K: all
    accepted) and differ there."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(mismatch_at), num_draft + 1, vocab_size, generator=gen)
    argmax = logits.argmax(-1)  # [batch_size, K + 1]
    drafts = argmax[:, :num_draft].clone()
    for row, j in enumerate(mismatch_at):
        if j < num_draft:
            drafts[row, j] = (argmax[row, j] + 1) % vocab_size
            drafts[row, j + 1:] = torch.randint(vocab_size, (num_draft - j - 1,), generator=gen)
    return logits, drafts, argmax


def _expected_greedy(argmax: torch.Tensor, drafts: torch.Tensor, mismatch_at: list[int]):
    expected = torch.full((len(mismatch_at), drafts.shape[1] + 1), -1)
    for row, j in enumerate(mismatch_at):
        expected[row, :j] = drafts[row, :j]
        expected[row, j] = argmax[row, j]
    return expected


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_follows_target_argmax(with_draft_probs):
    mismatch_at = [0, 1, 2, 3, 4, 4, 2]
    logits, drafts, argmax = _greedy_case(4, mismatch_at)
    draft_probs = torch.rand(7, 4, 20).softmax(-1) if with_draft_probs else None
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 7, "cpu")
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    result = rejection_sample(logits, drafts, draft_probs, st, [generator] * 7)
    assert result.num_accepted.tolist() == mismatch_at
    assert torch.equal(result.output_token_ids, _expected_greedy(argmax, drafts, mismatch_at))
    assert torch.equal(generator.get_state(), state)  # all greedy: nothing drawn


def test_greedy_rows_are_exact_in_a_mixed_batch():
    mismatch_at = [0, 3, 1, 3, 2, 0]
    logits, drafts, argmax = _greedy_case(3, mismatch_at)
    params = [SamplingParams(temperature=0.0 if row % 2 else 1.0) for row in range(6)]
    st = SamplingTensors.from_params(params, "cpu")
    draft_probs = torch.rand(6, 3, 20, generator=torch.Generator().manual_seed(1)).softmax(-1)
    result = rejection_sample(logits, drafts, draft_probs, st, [None] * 6)
    expected = _expected_greedy(argmax, drafts, mismatch_at)
    assert torch.equal(result.output_token_ids[1::2], expected[1::2])
    assert result.num_accepted[1::2].tolist() == mismatch_at[1::2]


def test_greedy_without_drafts_and_ties():
    logits = torch.tensor([[[0.0, 2.0, 2.0, 1.0]], [[3.0, 0.0, 3.0, 3.0]]])
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 2, "cpu")
    result = rejection_sample(logits, torch.zeros(2, 0, dtype=torch.int64), None, st,
                              [None, None])
    assert result.output_token_ids.tolist() == [[1], [0]]
    assert result.num_accepted.tolist() == [0, 0]


# ---------------------------------------------------------------- seeded reproducibility


def _random_batch(batch_size: int = 4, num_draft: int = 3, vocab_size: int = 50):
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(batch_size, num_draft + 1, vocab_size, generator=gen)
    draft_probs = (logits[:, :num_draft] + torch.randn(batch_size, num_draft, vocab_size,
                                                       generator=gen)).softmax(-1)
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=gen)
    return logits, drafts.view(batch_size, num_draft), draft_probs


def _seeded_run(rows: list[int], seeds: list[int]) -> torch.Tensor:
    logits, drafts, draft_probs = _random_batch()
    st = SamplingTensors.from_params([SamplingParams(temperature=1.5)] * len(rows), "cpu")
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return rejection_sample(logits[rows], drafts[rows], draft_probs[rows], st,
                            generators).output_token_ids


def test_same_seed_same_output():
    assert torch.equal(_seeded_run([0, 1, 2, 3], [5, 6, 7, 8]),
                       _seeded_run([0, 1, 2, 3], [5, 6, 7, 8]))
    outputs = {tuple(_seeded_run([0, 1, 2, 3], [s, s + 1, s + 2, s + 3]).flatten().tolist())
               for s in range(0, 40, 4)}
    assert len(outputs) > 1  # the seed matters: randomness is actually used


def test_row_seed_is_independent_of_batch():
    batched = _seeded_run([0, 1, 2, 3], [11, 12, 13, 14])
    for row, seed in enumerate([11, 12, 13, 14]):
        assert torch.equal(_seeded_run([row], [seed])[0], batched[row])
    # The same row keeps its result when moved to another place in the batch.
    reordered = _seeded_run([3, 2, 1, 0], [14, 13, 12, 11])
    assert torch.equal(reordered.flip(0), batched)


def test_default_generator_rows_run():
    logits, drafts, draft_probs = _random_batch()
    st = SamplingTensors.from_params([SamplingParams(top_p=0.9, top_k=10)] * 4, "cpu")
    torch.manual_seed(0)
    first = rejection_sample(logits, drafts, draft_probs, st, [None] * 4)
    torch.manual_seed(0)
    second = rejection_sample(logits, drafts, None, st, [None] * 4)
    torch.manual_seed(0)
    assert torch.equal(first.output_token_ids,
                       rejection_sample(logits, drafts, draft_probs, st,
                                        [None] * 4).output_token_ids)
    assert second.output_token_ids.shape == (4, 4)


# ---------------------------------------------------------------- validation


def _valid_inputs():
    logits, drafts, draft_probs = _random_batch()
    st = SamplingTensors.from_params([SamplingParams()] * 4, "cpu")
    return dict(target_logits=logits, draft_token_ids=drafts, draft_probs=draft_probs,
                sampling=st, generators=[None] * 4)


@pytest.mark.parametrize("field, bad, match", [
    ("target_logits", torch.zeros(4, 50), "target_logits"),
    ("target_logits", torch.zeros(4, 3, 50), "draft_token_ids"),
    ("draft_token_ids", torch.zeros(4, 2, dtype=torch.int64), "draft_token_ids"),
    ("draft_token_ids", torch.zeros(3, 3, dtype=torch.int64), "draft_token_ids"),
    ("draft_token_ids", torch.zeros(4, 3), "integer"),
    ("draft_probs", torch.zeros(4, 3, 49), "draft_probs"),
    ("draft_probs", torch.zeros(4, 4, 50), "draft_probs"),
    ("sampling", SamplingTensors.from_params([SamplingParams()] * 3, "cpu"), "sampling"),
    ("generators", [None] * 5, "generators"),
])
def test_bad_inputs_raise(field, bad, match):
    inputs = _valid_inputs()
    inputs[field] = bad
    with pytest.raises(ValueError, match=match):
        rejection_sample(**inputs)
