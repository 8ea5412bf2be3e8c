"""The adaptive policy's check of what speculation realized against what it predicted
(`spec_decode.realized`): speculating steps that realize less than predicted raise the gain
a choice must predict at that batch size, a bias the step-time model has on every step
cancels, and only decode steps run as a solve chose them are counted."""

from __future__ import annotations

import pytest

from specmoe.spec_decode.adaptive import AdaptivePolicy, AdaptiveSettings
from specmoe.spec_decode.realized import RealizedGain


def test_no_speculating_steps_leave_the_gain_asked_unchanged():
    r = RealizedGain()
    assert r.factor(1) == 1.0
    r.observe_off(1, 0.010, 0.010)
    assert r.factor(1) == 1.0


def test_speculation_realizing_less_than_predicted_asks_more_gain():
    """Steps predicted 1.5 tokens in 14 ms that emit 1.2: 80% of the predicted rate, the
    plain steps as predicted; shrunk by 8 pseudo-steps towards 1 while few are seen."""
    r = RealizedGain(window=10**9, prior_steps=8)
    r.observe_off(1, 0.010, 0.010)
    for _ in range(8):
        r.observe_on(1, 1.2, 0.014, 1.5, 0.014)
    assert r.factor(1) == pytest.approx(0.9)
    for _ in range(1000):
        r.observe_on(1, 1.2, 0.014, 1.5, 0.014)
    assert r.factor(1) == pytest.approx(0.8, abs=0.002)
    assert r.factor(2) == 1.0  # per batch size


def test_a_bias_of_the_step_time_model_on_every_step_cancels():
    """Every step 10% slower than predicted, plain or speculating: the gain is as
    predicted."""
    r = RealizedGain(prior_steps=0)
    for _ in range(50):
        r.observe_off(4, 0.011, 0.010)
        r.observe_on(4, 6.0, 0.0132, 6.0, 0.012)
    assert r.factor(4) == pytest.approx(1.0)


def test_the_factor_never_exceeds_one_and_follows_the_recent_steps():
    r = RealizedGain(window=16, prior_steps=0)
    for _ in range(100):
        r.observe_on(1, 2.0, 0.010, 1.5, 0.010)  # better than predicted: no bonus
    assert r.factor(1) == 1.0
    for _ in range(100):
        r.observe_on(1, 1.0, 0.010, 1.5, 0.010)
    assert r.factor(1) == pytest.approx(2 / 3, abs=0.01)  # the old steps decayed away


def _thin_gain_policy(acceptance: tuple[int, ...], check: bool = True) -> AdaptivePolicy:
    """A memory-bound target (10 ms a step whatever its rows), 4 ms of drafting a depth,
    and an engine-wide acceptance from `acceptance` (accepted of 4 drafts, in turn)."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=1000, realized_check=check))
    for rows in [1, 2, 4, 8, 16, 32, 64, 128]:
        p.observe_step(rows, 0.010)
    p.observe_draft(1, 0.004)
    for i in range(200):
        p.observe_verified("old", 4, acceptance[i % len(acceptance)])
    p.forget("old")
    return p


@pytest.mark.parametrize("check", [True, False])
def test_a_thin_predicted_gain_is_refused_where_speculation_realized_less(check):
    """Position-0 acceptance ~0.6, the rest ~0: K = 1 predicted ~14% faster than none. After
    speculating steps realized 70% of their predicted rate (their plain steps as
    predicted), a new request at one request stays off; with the check off, it drafts."""
    p = _thin_gain_policy((1, 1, 1, 0, 0), check)
    assert p.choose(["a"], [4], 1) == {"a": 1}
    for _ in range(64):
        p.realized.observe_on(1, 1.05, 0.014, 1.5, 0.014)
        p.realized.observe_off(1, 0.010, 0.010)
    assert p.choose(["b"], [4], 1) == ({"b": 0} if check else {"b": 1})


def test_a_large_predicted_gain_survives_the_same_shortfall():
    p = _thin_gain_policy((4, 4, 3, 4))
    for _ in range(64):
        p.realized.observe_on(1, 2.1, 0.026, 3.0, 0.026)
        p.realized.observe_off(1, 0.010, 0.010)
    assert p.choose(["a"], [4], 1)["a"] >= 3


def _speculating_policy(recorded: list) -> AdaptivePolicy:
    p = _thin_gain_policy((4, 4, 3, 4))
    p.realized.observe_on = lambda *a: recorded.append(("on", *a))
    p.realized.observe_off = lambda *a: recorded.append(("off", *a))
    return p


def test_a_speculating_step_is_counted_with_its_drafting_and_accepted_tokens():
    """A step run as the solve chose it adds its tokens (a token per request and the
    accepted drafts) and seconds (its forward and the drafting call before it), against
    the solve's expected tokens and seconds."""
    recorded = []
    p = _speculating_policy(recorded)
    ks = p.choose(["a", "b"], [4, 4], 2)
    assert ks == {"a": 4, "b": 4}
    expected = p._held.expected
    assert expected[0] == pytest.approx(2 + 2 * p.acceptance.gains("a").sum())
    assert expected[1] > 0.010  # the forward and the drafting
    p.observe_draft(4, 0.016)
    p.observe_verified("a", 4, 4)
    p.observe_verified("b", 4, 1)
    p.observe_step(10, 0.011, [5, 5])
    assert recorded == [("on", 2, 7, pytest.approx(0.027), *expected)]


def test_prompt_chunks_probes_and_uncalibrated_steps_are_not_counted():
    recorded = []
    p = _speculating_policy(recorded)
    assert p.choose(["a"], [4], 1) == {"a": 4}
    p.observe_draft(4, 0.016)
    p.observe_verified("a", 4, 2)
    p.observe_step(12, 0.012, [5, 7])  # a prompt chunk joined the step
    assert recorded == []
    fresh = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=1000))
    fresh.realized.observe_on = lambda *a: recorded.append(("on", *a))
    fresh.choose(["a"], [4], 1)  # uncalibrated: its own K
    fresh.observe_verified("a", 4, 4)
    fresh.observe_step(5, 0.010, [5])
    assert recorded == []


def test_probes_are_not_counted_and_plain_steps_are_against_the_step_model():
    recorded = []
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=3, probe_every_max=3,
                                        idle_observe_every=1))
    for rows in [1, 2, 4, 8, 16, 32, 64, 128]:
        p.observe_step(rows, 0.001 * rows)  # compute-bound: held at zero
    p.realized.observe_on = lambda *a: recorded.append(("on", *a))
    p.realized.observe_off = lambda *a: recorded.append(("off", *a))
    chosen = []
    for _ in range(6):
        chosen.append(p.choose(["a"], [4], 1)["a"])
        if chosen[-1]:
            p.observe_draft(chosen[-1], 0.004)
            p.observe_verified("a", chosen[-1], 0)
        p.observe_step(1 + chosen[-1], 0.001 * (1 + chosen[-1]), [1 + chosen[-1]])
    assert chosen == [0, 0, 4, 0, 0, 0]  # a probe on the third step, left out
    assert [r[0] for r in recorded] == ["off"] * 5
    assert recorded[0] == ("off", 1, 0.001, pytest.approx(0.001, rel=0.01))


def _noisy_and_steady(steps: int, z: float) -> tuple[float, float]:
    """Factors after `steps` speculating steps whose realized / predicted rate alternates
    0.6 / 1.1 (a noisy draw of acceptance) against steps that realize 0.85 every time: about
    the same point value."""
    noisy, steady = RealizedGain(window=10**9, prior_steps=0, z=z), RealizedGain(
        window=10**9, prior_steps=0, z=z)
    for i in range(steps):
        noisy.observe_on(4, 6.0 * (0.6 if i % 2 else 1.1), 0.020, 6.0, 0.020)
        steady.observe_on(4, 6.0 * 0.85, 0.020, 6.0, 0.020)
    return noisy.factor(4), steady.factor(4)


def test_noisy_steps_ask_less_until_the_evidence_is_strong():
    """Log ratios with a standard deviation of ~0.3: after 16 steps the upper bound is ~8%
    above the point value; after 1600 under 1%, so a real shortfall still counts."""
    noisy, steady = _noisy_and_steady(16, z=1.0)
    assert steady == pytest.approx(0.85)
    assert noisy > 0.9
    noisy, steady = _noisy_and_steady(1600, z=1.0)
    assert noisy == pytest.approx(0.85, abs=0.01)
    noisy, _ = _noisy_and_steady(16, z=0.0)
    assert noisy == pytest.approx(0.85, abs=0.005)


def test_the_realized_check_rejects_bad_settings():
    with pytest.raises(ValueError, match="window 0"):
        RealizedGain(window=0)
    with pytest.raises(ValueError, match="z -1"):
        RealizedGain(z=-1)


def test_batch_sizes_within_a_power_of_two_share_their_evidence():
    """Steps at 5, 6 and 7 requests realizing 80% of their prediction count for 8 (and the
    stats name the bucket by its top), not for 4 or 9."""
    r = RealizedGain(window=10**9, prior_steps=0, z=0)
    for batch in (5, 6, 7) * 20:
        r.observe_on(batch, 0.8 * 9, 0.020, 9.0, 0.020)
    assert r.factor(8) == pytest.approx(0.8)
    assert r.factor(5) == pytest.approx(0.8)
    assert r.factor(4) == 1.0 and r.factor(9) == 1.0
    assert set(r.factors) == {8}
