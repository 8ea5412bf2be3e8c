"""The adaptive policy's price of a draft model's catch-ups (`DraftDepthModel`,
`AdaptivePolicy._drafting`): the steady seconds per draft token apart from the seconds per
token of context a draft cache lacks, and each request's catch-up spread over the steps it
may still draft for."""

from __future__ import annotations

import numpy as np
import pytest

from specmoe.spec_decode.adaptive import AdaptivePolicy, AdaptiveSettings
from specmoe.spec_decode.choice import choose_ks, predicted_rate
from specmoe.spec_decode.time_models import DraftDepthModel

# a call's fixed cost; a draft token of the batch; a catch-up token
PER_CALL, PER_DEPTH, PER_TOKEN = 0.002, 0.010, 0.0008


def _call_s(depth: int, catch_ups: list[int]) -> float:
    return PER_CALL + PER_DEPTH * depth + PER_TOKEN * (sum(catch_ups) - len(catch_ups))


def test_the_depth_model_separates_steady_drafting_from_catch_ups():
    m = DraftDepthModel(window=64, min_calls=4)
    for depth, catch_ups in [(4, [1]), (4, [300]), (2, [2, 1]), (4, [1, 2]), (1, [90, 1]),
                             (3, [1, 1, 1]), (4, [1, 700])]:
        m.observe(depth, catch_ups, _call_s(depth, catch_ups))
    m.refresh()
    assert m.coef == pytest.approx((PER_CALL, PER_DEPTH, PER_TOKEN), rel=1e-6)


def test_no_fit_before_min_calls_and_empty_calls_are_ignored():
    m = DraftDepthModel(window=64, min_calls=4)
    m.observe(0, [5], 0.1)
    m.observe(4, [], 0.1)
    for _ in range(3):
        m.observe(4, [1], 0.04)
    m.refresh()
    assert m.coef is None


def _policy(c0: float = 0.030) -> AdaptivePolicy:
    """A memory-bound target (`c0` a step whatever its rows), 2.8 of 4 drafts accepted on
    average and the draft's calls seen: steady ones and prompts' catch-ups (~0.25 s)."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=1000, min_fit_steps=4))
    for rows in (1, 2, 5, 9, 3, 1, 6, 2):
        p.observe_step(rows, c0)
    for catch_ups in ([1], [300], [1], [2], [320], [1], [1], [280]):
        p.observe_draft(4, _call_s(4, catch_ups), catch_ups=catch_ups)
    for i in range(40):
        p.observe_verified("old", 4, (4, 3, 2, 4, 1)[i % 5])
    return p


def test_a_new_request_drafts_where_its_prompt_catch_up_is_paid_back():
    """The mean per depth with catch-ups averaged in is 0.032 s, which speculation on a
    30 ms step does not pay; priced apart, a 300-token prompt's 0.24 s catch-up pays
    over 32 tokens to come, not over 5."""
    assert _policy().draft_s > 0.030
    assert _policy().choose(["new"], [4], 1)["new"] == 0  # catch-ups unknown: the mean
    assert _policy().choose(["new"], [4], 1, [300], [32])["new"] == 4
    assert _policy().choose(["new"], [4], 1, [300], [5])["new"] == 0


def test_a_resuming_catch_up_is_spread_over_the_steps_left_at_most_the_horizon():
    p = _policy()
    gains = np.stack([p.acceptance.gains("a"), p.acceptance.gains("b")])
    caps = np.array([4, 4])
    per_step = 1.0 + gains.sum(axis=1)
    starts = p._drafting(["a", "b"], gains, caps, [301, 301], [20, 10_000])["starts"]
    assert starts == pytest.approx(
        [PER_TOKEN * 300 / (20 / per_step[0]), PER_TOKEN * 300 / 16], rel=1e-3)
    # drafting on the previous step: its catch-up recurs on every step, in full
    p._previous = {"a": 2}
    starts = p._drafting(["a", "b"], gains, caps, [3, 301], None)["starts"]
    assert starts == pytest.approx([PER_TOKEN * 2, PER_TOKEN * 300 / 16], rel=1e-3)


def test_start_costs_keep_the_dearest_request_off_and_the_rate_agrees():
    gains = np.tile(0.8 ** np.arange(1, 5), (3, 1))
    step = lambda drafts, misses, var=None: np.full(np.shape(drafts), 0.060)  # noqa: E731
    starts = np.array([0.0, 0.004, 0.5])
    ks, rate = choose_ks(gains, np.full(3, 4), step, PER_DEPTH, starts=starts)
    assert ks.tolist() == [4, 4, 0]
    assert rate == pytest.approx(predicted_rate(ks, gains, step, PER_DEPTH, starts=starts))
    assert predicted_rate(np.array([4, 4, 4]), gains, step, PER_DEPTH,
                          starts=starts) < rate


def test_requests_draft_their_own_k_until_the_drafting_model_is_fitted():
    """A policy that turned speculation off on its first step-time fit, with the drafting
    priced from a few catch-up calls, would see the draft again only in probes."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=1000, min_fit_steps=4))
    for rows in (1, 2, 5, 9, 3):
        p.observe_step(rows, 0.030)
    p.observe_draft(2, 0.5, catch_ups=[400, 300])
    assert not p.calibrated
    assert p.choose(["a", "b"], [4, 3], 2) == {"a": 4, "b": 3}
    for _ in range(3):
        p.observe_draft(4, 0.5)  # no catch-ups known: not the drafting model's
    assert not p.calibrated
    for _ in range(3):
        p.observe_draft(4, 0.04, catch_ups=[1, 2])
    assert p.calibrated and p.draft_depth.coef is None  # fitted when a solve asks
    # prompt lookup reports no catch-ups: the step-time model alone calibrates
    q = AdaptivePolicy(AdaptiveSettings(max_k=4, min_fit_steps=4))
    for rows in (1, 2, 5, 9):
        q.observe_step(rows, 0.030)
    q.observe_draft(4, 0.001)
    assert q.calibrated


def test_a_calls_fixed_cost_is_paid_once_where_any_request_drafts():
    gains = np.tile(0.5 ** np.arange(1, 5), (2, 1))  # 1.875 expected tokens from K = 4
    step = lambda drafts, misses, var=None: np.full(np.shape(drafts), 0.010)  # noqa: E731
    ks, rate = choose_ks(gains, np.full(2, 4), step, 0.001)
    assert ks.any()
    assert rate == pytest.approx(predicted_rate(ks, gains, step, 0.001))
    cheap_ks, cheap = choose_ks(gains, np.full(2, 4), step, 0.001, draft_call_s=0.002)
    assert cheap == pytest.approx(predicted_rate(cheap_ks, gains, step, 0.001,
                                                 draft_call_s=0.002)) and cheap < rate
    off, plain = choose_ks(gains, np.full(2, 4), step, 0.001, draft_call_s=0.012)
    assert not off.any() and plain == pytest.approx(2 / 0.010)


def _random_choice_inputs(rng: np.random.Generator) -> dict:
    """A batch as `AdaptivePolicy._solve` prices it: non-increasing gains, caps, a step
    time non-decreasing in rows and experts (hinged, as `StepTimeModel`'s non-negative
    fit), a MoE target's log-misses or none, catch-up starts (some zero)."""
    from specmoe.spec_decode.routing_overlap import miss_log
    b, max_k = int(rng.integers(1, 17)), int(rng.integers(1, 9))
    gains = np.cumprod(rng.uniform(0.05, 0.98, (b, max_k)), axis=1)
    base, c = float(rng.integers(b, 3 * b + 1)), rng.uniform(0, 1, 4) * [2e-3, 3e-4, 1e-3, 4e-3]
    knot = float(rng.integers(1, 64))

    def step(drafts, misses, var=None):
        rows = base + np.asarray(drafts, dtype=float)
        return (c[0] + c[1] * rows + c[2] * np.maximum(rows - knot, 0.0)
                + c[3] * (1.0 - np.exp(misses)))
    moe = rng.random() < 0.5
    kw = {"miss_step": miss_log(np.arange(1, max_k + 2), 64, 8, float(rng.uniform(0, 0.9)))
          if moe else None, "min_gain": float(rng.choice([0.0, 0.05]))}
    kw["starts"] = rng.uniform(0, 4e-3, b) * (rng.random(b) < 0.7)
    kw["draft_call_s"] = float(rng.uniform(0, 1e-3))
    return {"gains": gains, "caps": rng.integers(0, max_k + 1, b), "step_s": step,
            "draft_s": float(rng.uniform(1e-5, 2e-3))} | kw


def test_the_relaxed_bound_skips_only_searches_that_would_keep_the_batch_off(monkeypatch):
    """Over random batches, `choose_ks` with its relaxed bound (catch-ups free, drafts
    adding no experts) gives what the searches alone give, and the bound does end some
    solves early and lets others search."""
    from specmoe.spec_decode import choice
    real, outcomes = choice._relaxed_may_pay, []

    def counted(*args):
        outcomes.append(real(*args))
        return outcomes[-1]
    rng = np.random.default_rng(7)
    for _ in range(400):
        inputs = _random_choice_inputs(rng)
        monkeypatch.setattr(choice, "_relaxed_may_pay", counted)
        ks, rate = choice.choose_ks(**inputs)
        monkeypatch.setattr(choice, "_relaxed_may_pay", lambda *args: True)
        searched_ks, searched_rate = choice.choose_ks(**inputs)
        assert ks.tolist() == searched_ks.tolist() and rate == pytest.approx(searched_rate)
    assert outcomes.count(False) >= 20 and outcomes.count(True) >= 20
