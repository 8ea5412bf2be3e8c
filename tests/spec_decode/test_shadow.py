"""Shadow drafts (`spec_decode.shadow`): their resolution against the emitted tokens, and what
the adaptive policy learns from them (`AdaptivePolicy.observe_shadow`)."""

from __future__ import annotations

import pytest

from specmoe.spec_decode.adaptive import AdaptivePolicy, AdaptiveSettings
from specmoe.spec_decode.ngram import NgramProposer
from specmoe.spec_decode.shadow import ShadowDrafts, ShadowOutcome

PROMPT = [5, 6, 7]


def test_a_shadow_resolves_at_the_first_token_that_differs():
    s = ShadowDrafts(every=4)
    assert s.issue("a", len(PROMPT), 4, [10, 11, 12, 13], 2) is None
    assert s.resolve("a", PROMPT + [10]) is None  # the first draft emitted, more to come
    assert s.open_ids == ["a"]
    out = s.resolve("a", PROMPT + [10, 11, 99])
    assert out == ShadowOutcome("a", allowed=4, drafted=4, accepted=2, match_length=2)
    assert s.open_ids == [] and s.resolve("a", PROMPT + [10, 11, 99, 13]) is None


def test_a_shadow_whose_drafts_are_all_emitted_resolves_at_its_last():
    s = ShadowDrafts(every=1)
    s.issue("a", len(PROMPT), 3, [10, 11, 12], 3)
    assert s.resolve("a", PROMPT + [10, 11]) is None
    # several tokens in one step (the request speculates again): resolved all the same
    assert s.resolve("a", PROMPT + [10, 11, 12, 40, 41]).accepted == 3


def test_a_first_draft_rejected_resolves_on_the_next_token():
    s = ShadowDrafts(every=1)
    s.issue("a", len(PROMPT), 4, [10, 11], 1)
    assert s.resolve("a", PROMPT) is None  # nothing emitted yet
    assert s.resolve("a", PROMPT + [9]) == ShadowOutcome("a", 4, 2, 0, 1)


def test_shadows_are_spaced_and_an_empty_proposal_resolves_at_once():
    s = ShadowDrafts(every=4)
    assert s.due("a", 10)
    assert s.issue("a", 10, 4, [], 0) == ShadowOutcome("a", 4, 0, 0, 0)
    assert not s.due("a", 13) and s.due("a", 14)
    s.issue("a", 14, 2, [1, 2, 3], 1)  # at most `allowed` drafts kept
    assert not s.due("a", 30)  # one open at a time
    assert s.resolve("a", [0] * 14 + [1, 2]).drafted == 2
    assert s.due("a", 18) and not s.due("a", 17)


def test_forget_drops_a_request_and_a_bad_interval_is_named():
    s = ShadowDrafts(every=2)
    s.issue("a", 3, 2, [1, 2], 1)
    s.forget("a")
    assert s.open_ids == [] and s.due("a", 3) and s.resolve("a", [0, 0, 0, 1, 2]) is None
    with pytest.raises(ValueError, match="every=0"):
        ShadowDrafts(every=0)


def _calibrated(policy: AdaptivePolicy, c0: float, c1: float) -> None:
    for rows in [1, 2, 4, 8, 16, 32, 64, 128]:
        policy.observe_step(rows, c0 + c1 * rows)


def test_shadows_bring_a_request_held_at_zero_back():
    """A poor engine-wide start keeps a new request at K = 0; its shadows, all accepted,
    move its estimate, and the batch is re-solved after `shadow_every` steps, not the
    doubling recheck interval of a batch nothing informs."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, shadow_every=3, probe_every=1000,
                                        recheck_every=64, match_trim=False),
                       proposer=NgramProposer(1, 3))
    _calibrated(p, 1.0, 0.1)  # a step 1 s, each row 10% more
    for _ in range(40):
        p.observe_verified("old", 4, 0)  # every first draft rejected
    assert p.choose(["a"], [4], 1) == {"a": 0}
    for _ in range(10):
        p.observe_shadow(ShadowOutcome("a", 4, 4, 4, 0), 1)
    chosen = [p.choose(["a"], [4], 1)["a"] for _ in range(3)]
    assert chosen == [0, 0, 4]  # re-solved on the third step after the first solve
    assert p.acceptance.rates("a")[0] > 0.5


def test_a_shadow_counts_as_the_proposal_the_trim_would_keep():
    """A 1-gram proposal whose first draft is never accepted is cut to nothing: its shadow
    records an allowed slot left unfilled and no draft reached, while the match-length
    statistics see the whole proposal (and no cut is counted: none was verified)."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, shadow_every=8, probe_every=1000),
                       proposer=NgramProposer(1, 3))
    _calibrated(p, 0.010, 0.001)
    for _ in range(20):
        p.matches.observe(1, 4, 0)
    reached = p.matches._reached[1][0]
    p.observe_shadow(ShadowOutcome("a", 4, 4, 0, 1), 2)
    assert p.matches._reached[1][0] == reached + 1 and p.matches.trimmed == 0
    assert p.acceptance.fills("a")[0] < p.acceptance.fills("b")[0]  # b: the engine's prior
    assert "a" not in p.acceptance._requests  # nothing kept, nothing verified
    p.observe_shadow(ShadowOutcome("c", 4, 3, 2, 3), 2)  # 3-grams: unknown, kept whole
    assert p.acceptance._requests["c"][:, :3].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_a_shadowed_batch_kept_off_is_rechecked_within_the_solve_budget():
    """The hold of a batch kept off while shadows inform it: the solves' mean seconds at
    most `recheck_budget` of the held steps' predicted time, within [shadow_every,
    recheck_every_max]."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, shadow_every=8, recheck_every_max=256,
                                        recheck_budget=0.01), proposer=NgramProposer(1, 3))
    _calibrated(p, 0.010, 0.0)  # 10 ms a step
    p._solve_s = 0.00195
    assert p._shadow_recheck(4) == 20  # 1.95 ms within 1% of 20 steps of 10 ms
    p._solve_s = 0.0001
    assert p._shadow_recheck(4) == 8
    p._solve_s = 1.0
    assert p._shadow_recheck(4) == 256


def test_shadow_drafts_need_a_stateless_proposer():
    """Only a proposer that keeps no state (prompt lookup) is shadowed: a draft model's
    shadow would cost its forwards and catch-ups. shadow_every = 0 asks for none."""
    settings = AdaptiveSettings(max_k=4, shadow_every=8)
    assert AdaptivePolicy(settings, proposer=NgramProposer(1, 3)).shadow.every == 8
    assert AdaptivePolicy(AdaptiveSettings(max_k=4), proposer=object()).shadow is None

    class DraftModel:
        name = "draft"
    with pytest.raises(ValueError, match="stateless proposer.*'draft'"):
        AdaptivePolicy(settings, proposer=DraftModel())
