"""Trimming prompt-lookup proposals by their match length (`spec_decode.match_trim`): the
per-length rates, the cut at the threshold, exploration, and the adaptive policy's
threshold from its step-time model and expected rate."""

from __future__ import annotations

import pytest

from specmoe.spec_decode.adaptive import AdaptivePolicy, AdaptiveSettings
from specmoe.spec_decode.match_trim import MatchLengthTrim
from specmoe.spec_decode.ngram import NgramProposer, find_ngram_match
from specmoe.spec_decode.proposer import ProposeRequest
from specmoe.sampling_params import SamplingParams


def _trained(rates_by_n: dict[int, tuple[int, ...]], times: int = 80) -> MatchLengthTrim:
    """A trim fed `times` verified 4-draft proposals per match length, accepting each of
    the accepted counts in turn."""
    t = MatchLengthTrim(max_k=4, explore_every=1000, min_trials=16)
    for n, accepted in rates_by_n.items():
        for i in range(times):
            t.observe(n, 4, accepted[i % len(accepted)])
    return t


def test_gains_are_the_products_of_each_positions_rate():
    t = _trained({1: (0, 0, 0, 1), 3: (4, 4, 4, 2)})
    # 1-gram: a quarter accept the first draft, none of those the second
    assert t.gains(1)[:2] == pytest.approx([0.25, 0.0])
    # 3-gram: all accept two drafts, three quarters all four
    assert t.gains(3) == pytest.approx([1.0, 1.0, 0.75, 0.75])


def test_positions_with_few_drafts_keep_everything():
    t = MatchLengthTrim(max_k=4, min_trials=16)
    assert t.gains(2) == [1.0] * 4
    for _ in range(15):
        t.observe(2, 4, 0)
    assert t.gains(2) == [1.0] * 4  # 15 reached drafts: too few
    t.observe(2, 4, 0)
    assert t.gains(2) == [0.0] * 4
    assert t.cut([2], [4], _steep) == [0]


def _steep(keep: list[int]) -> float:
    """10 ms a step, each draft row 3 ms."""
    return 0.010 + 0.003 * sum(keep)


def test_the_drafts_kept_maximise_the_steps_expected_tokens_per_second():
    t = _trained({1: (0, 0, 0, 1), 3: (4, 4, 4, 2)})
    # alone: a 3-gram proposal is worth its four rows ((1 + 3.5) / 22 ms against 1 / 10
    # ms), a 1-gram's first draft is not (1.25 / 13 ms)
    assert t.cut([3], [4], _steep) == [4]
    assert t.cut([1], [4], _steep) == [0]
    # free rows: every draft expected to add a token is kept (never more than proposed),
    # those expected to add none are not
    assert t.cut([1, 3], [4, 1], lambda keep: 0.010) == [1, 1]
    # a draft model's proposal (match length 0) is kept whole
    assert t.cut([0, 1], [3, 4], _steep) == [3, 0]
    assert t.trimmed == 4 + 3 + 4


def test_the_cut_ranks_drafts_across_proposals_by_their_gain():
    """Rows free up to 12 then 5 ms each: of two 3-gram proposals (gains 1, 1, 0.75, 0.75)
    and a 2-gram one (gains 1, 0.5, 0, 0), the nine drafts of most gain fill the free
    rows, and the tenth (0.5) is not worth 5 ms."""
    t = _trained({2: (1, 2), 3: (4, 4, 4, 2)})
    assert t.gains(2) == pytest.approx([1.0, 0.5, 0.0, 0.0])
    step = lambda keep: 0.010 + 0.005 * max(0, 3 + sum(keep) - 12)  # noqa: E731
    assert t.cut([3, 2, 3], [4, 4, 4], step) == [4, 1, 4]


def test_every_explore_every_th_proposal_of_a_length_is_left_uncut():
    t = MatchLengthTrim(max_k=4, explore_every=4, min_trials=1)
    t.observe(1, 4, 0)
    kept = [t.cut([1], [4], _steep)[0] for _ in range(8)]
    assert kept == [0, 0, 0, 4, 0, 0, 0, 4]


def test_a_verification_counts_the_positions_reached():
    t = MatchLengthTrim(max_k=4, min_trials=1)
    t.observe(3, 3, 1)  # positions 0 and 1 reached, 0 accepted
    t.observe(3, 2, 2)  # positions 0 and 1 reached and accepted
    assert t._reached[3] == [2, 2, 0, 0] and t._accepted[3] == [2, 1, 0, 0]
    t.observe(0, 4, 4)
    t.observe(3, 0, 0)
    assert 0 not in t._reached and t._reached[3] == [2, 2, 0, 0]


def test_invalid_settings_raise():
    with pytest.raises(ValueError, match="explore_every=0"):
        MatchLengthTrim(max_k=4, explore_every=0)
    with pytest.raises(ValueError, match="max_k=0"):
        MatchLengthTrim(max_k=0)


def test_prompt_lookup_reports_its_match_length():
    assert find_ngram_match([1, 2, 3, 9, 1, 2, 3], 1, 3, 4) == ([9, 1, 2, 3], 3)
    assert find_ngram_match([5, 7, 8, 5], 1, 3, 4) == ([7, 8, 5], 1)
    assert find_ngram_match([1, 2, 3], 1, 3, 4) == ([], 0)
    req = ProposeRequest("r", [4, 5, 6, 4, 5], 2, SamplingParams(), None)
    proposal = NgramProposer(1, 3).propose([req])[0]
    assert proposal.token_ids == [6, 4] and proposal.match_length == 2


def _policy(trim: bool = True, num_experts: int = 0) -> AdaptivePolicy:
    """A step time of 10 ms + 1 ms a row (compute-bound from the first draft), prompt
    lookup (no drafting cost); 1-gram proposals accept nothing, 3-gram ones everything
    (`num_experts`: a MoE target with top-2 routing)."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=1000, match_trim=trim,
                                        match_trim_explore_every=1000,
                                        num_experts=num_experts, top_k=2 if num_experts else 0))
    for rows in [1, 2, 3, 4, 5, 8, 16, 32]:
        p.observe_step(rows, 0.010 + 0.001 * rows)
    p.observe_draft(1, 0.0)
    for _ in range(20):
        p.matches.observe(1, 4, 0)
        p.matches.observe(3, 4, 4)
    for _ in range(50):
        p.observe_verified("old", 4, 4)
    p.forget("old")
    return p


@pytest.mark.parametrize("num_experts", [0, 8])
def test_the_policy_cuts_proposals_on_a_step_its_solve_chose(num_experts):
    p = _policy(num_experts=num_experts)
    assert p.choose(["a", "b"], [4, 4], 2) == {"a": 4, "b": 4}
    # a 1-gram proposal's drafts add nothing and cost 1 ms each: cut; a 3-gram one's kept
    assert p.trim(["a", "b"], [4, 4], [1, 3], base_rows=2) == [0, 4]
    # the match lengths are remembered until verified, and feed the per-length rates
    p.observe_verified("b", 4, 4)
    assert p.matches._reached[3][0] == 21 and "b" not in p._match_of


def test_the_policy_keeps_every_draft_off_its_solves_or_with_the_trim_off():
    p = _policy(trim=False)
    p.choose(["a"], [4], 1)
    assert p.trim(["a"], [4], [1], base_rows=1) == [4]
    p = _policy()
    assert p.trim(["a"], [4], [1], base_rows=1) == [4]  # no choice made: nothing expected
    p.choose(["a"], [4], 1)
    assert p.trim(["a"], [3], [0], base_rows=1) == [3]  # a draft model's proposal
