"""The adaptive speculation policy (issue 26) on synthetic acceptance and step costs: high
acceptance on a memory-bound machine drafts deep, low acceptance or a compute-bound batch
drafts nothing, hysteresis holds a choice against small changes, requests held at K = 0 are
re-probed, and the acceptance estimate starts at the engine's rate and moves to the request's."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from specmoe.spec_decode.adaptive import AcceptanceTracker, AdaptivePolicy, AdaptiveSettings
from specmoe.spec_decode.choice import choose_ks, predicted_rate
from specmoe.spec_decode.time_models import StepTimeModel


def _gains(rate: float, b: int, max_k: int = 8) -> np.ndarray:
    return np.tile(np.cumprod(np.full(max_k, rate)), (b, 1))


def _linear(c0: float, c1: float, base_rows: int):
    return lambda drafts, misses=None, var=None: c0 + c1 * (
        base_rows + np.asarray(drafts, dtype=float))


def test_memory_bound_and_high_acceptance_drafts_deep():
    # a step costs 10 ms whatever its rows (memory-bound), drafting 1 ms per depth
    ks, rate = choose_ks(_gains(0.9, 2), np.array([8, 8]), _linear(0.010, 0.0, 2), 0.001)
    assert ks.tolist() == [8, 8]
    assert rate == pytest.approx(predicted_rate(ks, _gains(0.9, 2), _linear(0.010, 0.0, 2),
                                                0.001))
    assert rate > 2 / 0.010  # better than no speculation


def test_low_acceptance_or_compute_bound_drafts_nothing():
    ks, rate = choose_ks(_gains(0.05, 4), np.full(4, 8), _linear(0.010, 0.0, 4), 0.002)
    assert ks.tolist() == [0, 0, 0, 0] and rate == pytest.approx(4 / 0.010)
    # compute-bound: every row costs as much as a whole token's worth of time
    ks, _ = choose_ks(_gains(0.8, 32), np.full(32, 8), _linear(0.0, 0.001, 32), 0.0)
    assert ks.sum() == 0


def test_hopeless_speculation_skips_the_search():
    """Acceptance so low that even every draft accepted at no extra step cost loses to
    the draft's own time: one prediction (the plain step), no search over depths."""
    calls = []

    def step(drafts, misses=None, var=None):
        calls.append(1)
        return _linear(0.010, 0.0, 4)(drafts)
    ks, rate = choose_ks(_gains(0.01, 4), np.full(4, 8), step, 0.005)
    assert ks.tolist() == [0, 0, 0, 0] and rate == pytest.approx(4 / 0.010)
    assert len(calls) == 1
    # with a free draft the bound cannot rule speculation out: the depths are searched
    calls.clear()
    ks, _ = choose_ks(_gains(0.01, 4), np.full(4, 8), step, 0.0)
    assert len(calls) > 1


def test_a_gain_below_min_gain_keeps_speculation_off():
    """One draft predicted 2.7% faster than none: taken with no margin, refused with the
    policy's 5% (what the step-time model leaves out costs about that much)."""
    gains = np.array([[0.5, 0.0, 0.0, 0.0]])
    step = lambda d, m=None, var=None: 0.010 + 0.0046 * np.asarray(d, float)  # noqa: E731
    ks, rate = choose_ks(gains, np.array([4]), step, 0.0)
    assert ks.tolist() == [1] and rate == pytest.approx(1.5 / 0.0146)
    ks, rate = choose_ks(gains, np.array([4]), step, 0.0, min_gain=0.05)
    assert ks.tolist() == [0] and rate == pytest.approx(100.0)
    assert AdaptiveSettings(max_k=4).min_gain == 0.05


def test_medium_case_takes_the_best_drafts_first_and_respects_caps():
    gains = np.stack([np.cumprod(np.full(8, 0.95)), np.cumprod(np.full(8, 0.3))])
    step = _linear(0.010, 0.0005, 2)
    ks, _ = choose_ks(gains, np.array([3, 8]), step, 0.0)
    assert ks[0] == 3  # capped by its own K
    assert ks[1] < ks[0]
    # exhaustive check that no other K vector of these caps is faster
    best = max(predicted_rate(np.array([a, b]), gains, step, 0.0)
               for a in range(4) for b in range(9))
    assert predicted_rate(ks, gains, step, 0.0) == pytest.approx(best)


def test_slots_the_proposer_rarely_fills_cost_their_expected_rows():
    """Prompt lookup fills deep slots only where a match runs on. A step costs the same up
    to 4 rows and 2 ms per row beyond: when every slot fills, three drafts fit the flat
    part; when slots 3..8 fill a fifth of the time, each adds a fifth of a row in
    expectation and six of them still fit. The predicted rate counts the same rows."""
    acc = np.cumprod(np.full(8, 0.7))[None, :]

    def step(drafts, misses=None, var=None):
        return 0.005 + 0.002 * np.maximum(0.0, 1 + np.asarray(drafts, dtype=float) - 4)
    full, _ = choose_ks(acc, np.array([8]), step, 0.0)
    fills = np.array([[1.0, 1.0, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]])
    ks, rate = choose_ks(acc * fills, np.array([8]), step, 0.0, fills=fills)
    assert full[0] == 3 and ks[0] == 7
    assert rate == pytest.approx(predicted_rate(ks, acc * fills, step, 0.0, fills=fills))
    best = max(predicted_rate(np.array([k]), acc * fills, step, 0.0, fills=fills)
               for k in range(9))
    assert rate == pytest.approx(best)


def test_fill_rates_start_at_one_and_follow_the_proposals():
    t = AcceptanceTracker(max_k=4, prior_strength=4.0)
    assert t.fills("new").tolist() == [1.0] * 4  # a draft model's, until told otherwise
    for _ in range(30):
        t.observe_proposed("lookup", 4, 1)  # one token of the four asked for
        t.observe_proposed("lookup", 2, 2)  # slots never asked for stay unobserved
    f = t.fills("lookup")
    assert f[0] > 0.95 and f[1] == pytest.approx((30 + 4 * 31 / 61) / 64)
    assert f[2] < 0.1 and np.all(np.diff(f) <= 0) and np.all(f >= 0.01)
    assert t.fills("other")[2] == pytest.approx(1 / 31)  # the engine's rate as the prior
    t.observe("lookup", 2, 2)
    assert np.allclose(t.gains("lookup"), f * np.cumprod(t.rates("lookup")))
    t.forget("lookup")
    assert t.fills("lookup")[2] == pytest.approx(1 / 31)


def test_acceptance_starts_at_the_engine_rate_and_moves_to_the_request():
    t = AcceptanceTracker(max_k=4, prior_strength=4.0)
    for _ in range(50):
        t.observe("good", 4, 4)      # every draft accepted
    fresh = t.rates("new")
    assert fresh[0] == pytest.approx(51 / 52)
    for _ in range(50):
        t.observe("bad", 4, 0)       # the first draft rejected: position 0 reached only
    assert t.rates("bad")[0] < 0.1
    assert t.rates("bad")[1] == pytest.approx(t.rates("new")[1])  # never reached: the prior
    assert np.all(np.diff(t.gains("good")) <= 0)
    t.forget("bad")
    assert t.rates("bad")[0] == pytest.approx(t.rates("new")[0])


def test_the_engine_rate_is_optimistic_while_few_drafts_were_seen():
    """An upper confidence bound: two rejected first drafts leave room to try again, forty
    rejections of fifty do not."""
    bold = AcceptanceTracker(max_k=2, prior_strength=4.0, optimism=1.0)
    plain = AcceptanceTracker(max_k=2, prior_strength=4.0)
    for t in (bold, plain):
        t.observe("a", 2, 0)
        t.observe("a", 2, 0)
    assert plain.rates("new")[0] == pytest.approx(1 / 4)
    assert bold.rates("new")[0] == pytest.approx(1 / 4 + np.sqrt(3 / 16 * 2) / 4)  # 0.40
    assert bold.rates("new")[1] == plain.rates("new")[1] == 0.5  # never reached
    for t in (bold, plain):
        for i in range(48):
            t.observe("b", 2, int(i % 5 == 0))  # 10 of 48 accepted
    mean = 11 / 52
    assert plain.rates("new")[0] == pytest.approx(mean)
    assert bold.rates("new")[0] == pytest.approx(mean + np.sqrt(mean * (1 - mean) * 50) / 52)
    assert bold.rates("new")[0] - mean < 0.06
    assert np.all(bold.rates("new") <= 1.0)


def test_step_time_model_is_flat_where_memory_bound_and_steep_where_compute_bound():
    m = StepTimeModel(window=64, min_steps=8)
    assert m.predict(10) is None
    truth = lambda r: max(0.010, 0.0002 * r)  # noqa: E731 - the roofline's shape
    for rows in [1, 2, 3, 5, 8, 16, 40, 64, 128, 256, 512, 1]:
        m.observe(rows, truth(rows))
    for rows in (1, 4, 200, 512):
        assert m.predict(rows) == pytest.approx(truth(rows), rel=0.15)
        assert m.predict_one(rows) == pytest.approx(float(m.predict(rows)))
    # a few draft rows on one request cost next to nothing, as measured
    assert m.predict(5) - m.predict(1) < 0.1 * m.predict(1)


def test_the_step_from_one_row_to_two_is_learnt():
    """A matrix-vector step at one row, matrix-matrix from two (as measured on SmolLM2):
    the second row costs five times each later one, which a line through the points
    cannot price."""
    m = StepTimeModel(window=64, min_steps=8)
    truth = lambda r: 0.0062 + 0.0014 * (r > 1) + 0.00035 * r  # noqa: E731
    for rows in [1, 2, 3, 4, 5, 6, 8, 12, 1, 1, 2, 16]:
        m.observe(rows, truth(rows))
    for rows in (1, 2, 5, 9):
        assert m.predict(rows) == pytest.approx(truth(rows), rel=0.02)
        assert m.predict_one(rows) == pytest.approx(float(m.predict(rows)))
    assert m.predict(1.5) == pytest.approx((truth(1) + truth(2)) / 2, rel=0.02)


def test_step_time_is_never_predicted_as_zero():
    """Steps of 12-15 rows only: the fit may weigh the hinge alone, which is 0 below 8
    rows; a 1-row step is then predicted at no less than half the fastest step seen (a
    zero once divided the policy's tokens per second and failed the engine's step)."""
    m = StepTimeModel(window=64, min_steps=4)
    for rows, secs in [(15, 0.018), (12, 0.010), (12, 0.011), (12, 0.009), (12, 0.0093)]:
        m.observe(rows, secs)
    m.coef = np.array([0.0, 0.0, 0.0, 0.0, 0.002, 0.0, 0.0])  # a degenerate fit: the 8-row hinge
    assert m.predict(1) == pytest.approx(0.5 * 0.009)
    assert m.predict_one(1) == pytest.approx(0.5 * 0.009)
    assert m.predict(15) == pytest.approx(0.014)


def test_the_step_time_model_refits_once_an_eighth_of_its_window_is_new():
    """A few new steps in a full window hardly move the fit (each costs ~0.3 ms): a
    prediction refits after max(4, steps held / 8) new ones."""
    m = StepTimeModel(window=64, min_steps=8)
    for rows in [1, 2, 4, 8, 16, 32, 64, 128] * 8:  # 64 steps at 1 ms a row
        m.observe(rows, 0.001 * rows)
    m.refresh()
    fitted = m.predict(16)
    for _ in range(7):
        m.observe(16, 0.032)  # twice as slow: 7 of 8 steps needed
    assert m.predict(16) == fitted
    m.observe(16, 0.032)
    assert m.predict(16) > fitted


def _calibrated(policy: AdaptivePolicy, c0: float, c1: float) -> None:
    for rows in [1, 2, 4, 8, 16, 32, 64, 128]:
        policy.observe_step(rows, c0 + c1 * rows)


def test_policy_uses_own_k_until_calibrated_then_chooses_and_holds():
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, hysteresis=0.05, probe_every=1000))
    assert p.choose(["a", "b"], [4, 2], 2) == {"a": 4, "b": 2}
    _calibrated(p, 0.010, 0.0)
    for _ in range(20):
        p.observe_verified("a", 4, 4)
    assert p.choose(["a"], [4], 1) == {"a": 4}
    assert p.observe_step(5, 0.011) == pytest.approx(1 / 11)  # predicted 10 ms
    # a small change of the estimate does not flip the choice (hysteresis) ...
    p.observe_verified("a", 4, 3)
    assert p.choose(["a"], [4], 1) == {"a": 4}


def test_requests_held_at_zero_are_reprobed():
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=3, probe_every_max=3))
    _calibrated(p, 0.0, 0.001)  # compute-bound: speculation never pays
    chosen = [p.choose(["a"], [3], 1)["a"] for _ in range(9)]
    assert chosen == [0, 0, 3, 0, 0, 3, 0, 0, 3]  # a probe drafts the request's own K
    assert p.choose(["b"], [8], 1) == {"b": 0} and p.choose(["b"], [8], 1) == {"b": 0}
    assert p.choose(["b"], [8], 1) == {"b": 4}  # at most K_max


def test_steps_held_at_zero_are_recorded_one_in_idle_observe_every():
    """Steps of a batch held at K = 0 repeat one another's rows: one in
    `idle_observe_every` is recorded (and its error reported), every one still counts
    towards the probes' time budget; a speculating batch records every step."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, idle_observe_every=4, probe_every=1000))
    _calibrated(p, 0.0, 0.001)  # compute-bound: held at zero
    assert p.choose(["a"], [4], 1) == {"a": 0}
    observed, elapsed = p.step_time._observed, p._elapsed_s
    errors = [p.observe_step(1, 0.002) for _ in range(8)]
    assert p.step_time._observed - observed == 2
    assert [e is not None for e in errors] == [False, False, False, True] * 2
    assert p._elapsed_s - elapsed == pytest.approx(0.016)
    q = AdaptivePolicy(AdaptiveSettings(max_k=4, idle_observe_every=4, probe_every=1000))
    _calibrated(q, 0.010, 0.0)
    for _ in range(20):
        q.observe_verified("a", 4, 4)
    assert q.choose(["a"], [4], 1) == {"a": 4}
    observed = q.step_time._observed
    assert all(q.observe_step(5, 0.010) is not None for _ in range(8))
    assert q.step_time._observed - observed == 8


def test_probes_back_off_while_they_find_nothing_and_reset_once_speculation_pays():
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=2, probe_every_max=8,
                                        recheck_every=1, recheck_every_max=1))
    _calibrated(p, 0.0, 0.001)  # compute-bound
    chosen = [p.choose(["a"], [4], 1)["a"] for _ in range(24)]
    probes = [i + 1 for i, k in enumerate(chosen) if k]
    assert probes == [2, 6, 14, 22]  # intervals 2, 4, 8, then capped at 8
    assert p.probe_interval == 8
    for _ in range(8):  # memory-bound now (a quarter of the steps recorded while held at
        _calibrated(p, 0.010, 0.0)  # K = 0), and the draft is always right
    for _ in range(20):
        p.observe_verified("a", 4, 4)
    assert p.choose(["a"], [4], 1)["a"] == 4
    assert p.probe_interval == 2


def test_requests_held_at_zero_probe_on_the_same_step(monkeypatch):
    """Requests that joined at different steps probe together (one draft run for the
    batch), and while every request stays at K = 0 the choice is re-solved only after a
    probe, when the batch changes or every `recheck_every` steps."""
    import specmoe.spec_decode.adaptive.solve as adaptive
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=4, recheck_every=5,
                                        recheck_every_max=5))
    p.clock = lambda: 0.0  # solves that cost nothing: a join is solved for at once
    _calibrated(p, 0.0, 0.001)
    solves = []
    real = adaptive.choose_ks
    monkeypatch.setattr(adaptive, "choose_ks", lambda *a, **kw: solves.append(1) or real(*a, **kw))
    steps = [p.choose(["a"], [4], 1), p.choose(["a"], [4], 1),
             p.choose(["a", "b"], [4, 4], 2), p.choose(["a", "b"], [4, 4], 2),
             p.choose(["a", "b"], [4, 4], 2), p.choose(["a", "b", "c"], [4, 4, 0], 3)]
    assert [sum(s.values()) for s in steps] == [0, 0, 0, 8, 0, 0]  # a and b at step 4
    assert steps[3] == {"a": 4, "b": 4}
    assert len(solves) == 4  # step 1, the batch growing at steps 3 and 6, after the probe
    for _ in range(5):
        p.choose(["a", "b", "c"], [4, 4, 0], 3)
    assert len(solves) == 5  # re-solved once recheck_every steps have passed


def _engine_steps(policy: AdaptivePolicy, batches: list[list[str]], lease: bool,
                  seconds: float = 0.001) -> tuple[list[dict[str, int]], int]:
    """The Ks chosen for each step's batch by a policy driven as `EngineCore.step` drives it
    (a forward of one row per request, then the choice; `lease`: with its idle leases), and
    the number of leased steps."""
    chosen, leased = [], 0
    for batch in batches:
        if lease and policy.leased_step(batch, seconds * len(batch)):
            chosen.append(dict.fromkeys(batch, 0))
            leased += 1
            continue
        policy.end_lease()
        policy.observe_step(len(batch), seconds * len(batch))
        ks = policy.choose(batch, [4] * len(batch), len(batch))
        if lease and not any(ks.values()):
            policy.grant_lease(batch)
        if any(ks.values()):
            policy.observe_draft(max(ks.values()), 0.02)
        chosen.append(ks)
    return chosen, leased


def test_idle_leases_choose_what_choose_would_on_every_step():
    """Leased steps skip `choose` and `observe_step`, yet probes, re-solves and rechecks
    come on the same steps as without leases (the counts handed over when a lease ends),
    across a request joining (held at K = 0 until the solves' budget allows its solve)
    and leaving, with probes due by their count of steps or waiting on their time budget
    (20 ms of drafting at a budget of a half: 20 ms more, 20 steps of one request, 10 of
    two)."""
    batches = [["a"]] * 60 + [["a", "b"]] * 90 + [["b"]] * 60
    runs = []
    for lease in (False, True):
        p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=4, probe_every_max=16,
                                            recheck_every=3, recheck_every_max=12,
                                            probe_budget=0.5))
        p.clock = itertools.count(step=0.0002).__next__  # 0.2 ms a solve: b waits 20 ms
        _calibrated(p, 0.0, 0.001)  # compute-bound: held at zero but for the probes
        chosen, leased = _engine_steps(p, batches, lease)
        assert (leased > len(batches) // 2) == lease
        p.end_lease()  # a lease still running
        runs.append((chosen, p._since_probe, p.probe_interval, p._elapsed_s, p._solves))
    assert runs[0][0] == runs[1][0]
    probes = [i for i, ks in enumerate(runs[0][0]) if any(ks.values())]
    gaps = {b - a for a, b in zip(probes, probes[1:])}
    assert len(probes) >= 8 and 16 in gaps and max(gaps) > 16  # by count, by time
    assert runs[0][1:] == pytest.approx(runs[1][1:])


def test_an_ended_lease_records_one_timing_at_its_mean():
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=1000))
    _calibrated(p, 0.0, 0.001)
    assert p.choose(["a"], [4], 1) == {"a": 0}
    p.grant_lease(["a"])
    assert p.lease is not None and p.lease.left > 3
    observed = p.step_time._observed
    assert all(p.leased_step(["a"], t) for t in (0.001, 0.002, 0.003))
    assert not p.leased_step(["a", "b"], 0.001) and p.lease is not None
    assert p.end_lease() == pytest.approx(0.5)  # predicted 1 ms, ran 2 ms on average
    assert p.step_time._observed == observed + 1 and p.step_time._steps[-1][1] == 0.002
    assert p.lease is None and p.end_lease() is None


def _solved_at(monkeypatch, policy: AdaptivePolicy, batch: list[str], steps: int,
               expected: dict[str, int] | None = None) -> list[int]:
    """The steps (1..steps) on which `policy.choose(batch, [4, ...], len(batch))` solved,
    each choice checked against `expected` where given."""
    import specmoe.spec_decode.adaptive.solve as adaptive
    from specmoe.spec_decode.choice import choose_ks as real
    solved, step = [], 0
    monkeypatch.setattr(adaptive, "choose_ks", lambda *a, **kw: solved.append(step) or real(*a, **kw))
    for step in range(1, steps + 1):
        chosen = policy.choose(batch, [4] * len(batch), len(batch))
        assert expected is None or chosen == expected
    return solved


def test_a_batch_kept_off_is_rechecked_ever_less_often(monkeypatch):
    """A solve that keeps speculation off after a hold that was off doubles the hold (2,
    4, 8, then the cap of 8), also where the batch changed (a request joining is still
    solved for at once)."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, recheck_every=2, recheck_every_max=8,
                                        probe_every=1000))
    p.clock = lambda: 0.0  # solves that cost nothing (`test_a_join_into_a_batch_kept_off...`)
    _calibrated(p, 0.0, 0.001)  # compute-bound: held at zero
    assert _solved_at(monkeypatch, p, ["a"], 29, {"a": 0}) == [1, 3, 7, 15, 23]
    # the join, then after the hold of 8
    assert _solved_at(monkeypatch, p, ["a", "b"], 9, {"a": 0, "b": 0}) == [1, 9]


def test_a_join_into_a_batch_kept_off_waits_for_the_solves_budget(monkeypatch):
    """Requests joining a batch held at K = 0 are held with it until the solves since the
    last one fit `recheck_budget` of the steps' time (solves of 1 ms at 10%: 10 ms, five
    2.1 ms steps of two requests), their steps leased until the step the budget allows
    the solve. A batch of new requests only is solved for at once (and a speculating
    one: `test_a_speculating_batch_is_re_solved_every_few_steps`)."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, recheck_every=64, recheck_every_max=64,
                                        probe_every=1000, recheck_budget=0.1))
    p.clock = itertools.count(step=0.001).__next__  # every solve takes 1 ms
    _calibrated(p, 0.0, 0.001)  # compute-bound: held at zero
    assert _solved_at(monkeypatch, p, ["a"], 1, {"a": 0}) == [1]
    solved, leased = [], []
    for step in range(1, 9):
        if p.leased_step(["a", "b"], 0.0021):
            leased.append(step)
            continue
        p.end_lease()
        p.observe_step(2, 0.0021)
        before = p._solves
        assert p.choose(["a", "b"], [4, 4], 2) == {"a": 0, "b": 0}
        if p._solves > before:
            solved.append(step)
        p.grant_lease(["a", "b"])
    assert solved == [5] and leased == [2, 3, 4, 6, 7, 8]
    assert _solved_at(monkeypatch, p, ["c"], 1, {"c": 0}) == [1]  # none goes on


def test_a_speculating_batch_is_re_solved_every_few_steps(monkeypatch):
    """While speculation pays, the same batch keeps its Ks for `resolve_every` steps (caps
    still apply, a request may leave); a request joining is solved for at once."""
    import specmoe.spec_decode.adaptive.solve as adaptive
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, resolve_every=3, probe_every=1000))
    _calibrated(p, 0.010, 0.0)
    for _ in range(20):
        p.observe_verified("a", 4, 4)
    solves = []
    real = adaptive.choose_ks
    monkeypatch.setattr(adaptive, "choose_ks", lambda *a, **kw: solves.append(1) or real(*a, **kw))
    chosen = [p.choose(["a"], [cap], 1)["a"] for cap in (4, 4, 2, 4)]
    assert chosen == [4, 4, 2, 4] and len(solves) == 2  # steps 1 and 4
    p.choose(["a", "b"], [4, 4], 2)
    assert len(solves) == 3
    assert p.choose(["b"], [4], 1) == {"b": 4} and len(solves) == 3  # a left: held


def test_drafts_beside_a_prompt_chunk_are_priced_at_its_margin():
    """Drafts proposed for a decode-only step, then scheduled beside a prompt chunk, are
    priced at what a row adds to that compute-bound step against a plain decode step's
    rate: drafts free in an eight-request decode step are dropped beside a 200-row prefill,
    the held choice goes on afterwards, and where rows cost nothing all are kept."""
    batch = [f"r{i}" for i in range(8)]

    def policy(slope: float) -> AdaptivePolicy:
        p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=1000))
        for rows in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]:  # flat to 32 rows, then steep
            p.observe_step(rows, 0.010 + slope * max(0, rows - 32))
        for r in batch:
            for _ in range(20):
                p.observe_verified(r, 4, 4)
        return p
    p = policy(0.002)  # 2 ms a row past 32: a draft's token at most 0.5 a ms, plain 0.8
    decode = p.choose(batch, [4] * 8, 8)
    assert set(decode.values()) == {3}  # 8 x 4 rows: the most that stay flat
    assert p.beside_prompts(batch, [3] * 8, 8, 0) == [3] * 8
    assert p.beside_prompts(batch, [3] * 8, 8, 200) == [0] * 8
    assert p.prompt_cut_steps == 1
    assert p.choose(batch, [4] * 8, 8) == decode
    p = policy(0.0005)  # 0.5 ms a row: accepted drafts beat the decode rate, the rest not
    kept = p.beside_prompts(batch, [3, 3, 0, 1, 3, 3, 3, 3], 8, 200)
    assert kept[2:4] == [0, 1] and 0 < min(kept[:2] + kept[4:]) and max(kept) <= 3
    flat = policy(0.0)
    assert flat.beside_prompts(batch, [3] * 8, 8, 200) == [3] * 8
    assert flat.prompt_cut_steps == 0


def test_a_confirmed_choice_is_held_longer(monkeypatch):
    """A solve that returns the Ks it held doubles the hold (3, 6, 12, then the cap of
    12); a new batch restarts it."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, resolve_every=3, resolve_every_max=12,
                                        probe_every=1000))
    _calibrated(p, 0.010, 0.0)
    for _ in range(20):
        p.observe_verified("a", 4, 4)
    assert _solved_at(monkeypatch, p, ["a"], 39, {"a": 4}) == [1, 4, 10, 22, 34]
    assert _solved_at(monkeypatch, p, ["a", "b"], 4) == [1, 4]


def test_a_probe_with_known_catch_ups_takes_the_cheapest_within_its_budget():
    """A draft model must first run a held request's unseen tokens: a probe takes the held
    requests of least catch-up while they fit `probe_catch_up_rows`, none whose catch-up
    alone exceeds it."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=2, probe_every_max=2,
                                        probe_catch_up_rows=100))
    _calibrated(p, 0.0, 0.001)  # compute-bound: every request held at K = 0
    ids, caps = ["a", "b", "c", "d", "e"], [4, 4, 4, 0, 4]
    pending = [300, 40, 50, 1, 20]  # d may not draft (cap 0)
    assert sum(p.choose(ids, caps, 5, pending).values()) == 0
    assert p.choose(ids, caps, 5, pending) == {"a": 0, "b": 4, "c": 0, "d": 0, "e": 4}
    p.choose(ids, caps, 5, [300, 400, 500, 1, 200])
    # every catch-up over budget on its own: no probe
    assert p.choose(ids, caps, 5, [300, 400, 500, 1, 200]) == {
        "a": 0, "b": 0, "c": 0, "d": 0, "e": 0}
    # without catch-ups (n-gram drafting costs no draft forward) every held request probes
    p.choose(ids, caps, 5)
    assert p.choose(ids, caps, 5) == {"a": 4, "b": 4, "c": 4, "d": 0, "e": 4}


def test_a_probe_adds_at_most_probe_drafts_slots_taking_turns():
    """Sixteen requests held at K = 0 probing K_max = 8 each would add 128 rows to one
    step (three steps' worth of SmolLM2 at C = 16): a probe takes the least probed
    requests while their drafts fit `probe_drafts`, at least one."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=8, probe_every=2, probe_every_max=2,
                                        probe_drafts=16))
    _calibrated(p, 0.0, 0.001)
    ids = ["a", "b", "c", "d", "e"]
    probed = []
    for _ in range(6):
        ks = p.choose(ids, [8] * 5, 5)
        probed.append("".join(r for r in ids if ks[r]))
    assert [x for x in probed if x] == ["ab", "cd", "ae"]  # e (never probed), then a
    p = AdaptivePolicy(AdaptiveSettings(max_k=32, probe_every=1, probe_drafts=16))
    _calibrated(p, 0.0, 0.001)
    assert p.choose(["a"], [32], 1) == {"a": 32}  # one request, over the budget alone


def test_probes_wait_until_their_drafting_fits_the_budget():
    """A probe whose drafting took 50 ms, against 10 ms steps and a 10% budget: the next
    waits until 0.5 s have passed since it began, not just `probe_every` steps."""
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=2, probe_every_max=2,
                                        probe_budget=0.1))
    _calibrated(p, 0.0, 0.001)  # compute-bound: held at K = 0
    steps = []
    for i in range(70):
        ks = p.choose(["a"], [4], 1)
        if ks["a"]:
            steps.append(i)
            p.observe_draft(4, 0.05)
        p.observe_step(1, 0.01)
    # 0.5 s since the last probe began: its own 60 ms, then 44 steps of 10 ms
    assert steps[0] == 1 and steps[1] - steps[0] == 45
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=2, probe_every_max=2))
    _calibrated(p, 0.0, 0.001)
    probes = [i for i in range(8) if p.choose(["a"], [4], 1)["a"]]
    assert probes == [1, 3, 5, 7]  # n-gram: no drafting time, the interval alone


def test_a_probes_verification_counts_towards_its_cost():
    """Drafting free (n-gram), 1 ms a row, 1 ms steps, a 10% budget: a probe of 4 drafts
    with 1 accepted runs 5 rows in 9 ms where the step without them, taking as long for
    the extra token, would take 2 ms: 7 ms of cost, so the next probe waits until 70 ms
    have passed since it began (the 9 ms step and 61 of 1 ms); a verification no dearer than
    the plain step for its tokens (2 ms) leaves the probes to their interval."""
    def probes(probe_s: float) -> list[int]:
        p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=2, probe_every_max=2,
                                            probe_budget=0.1))
        _calibrated(p, 0.0, 0.001)
        steps, drafted = [], 0
        for i in range(140):
            if drafted:
                p.observe_verified("a", drafted, 1)
            p.observe_step(1 + drafted, probe_s if drafted else 0.001)
            drafted = p.choose(["a"], [4], 1)["a"]
            if drafted:
                steps.append(i)
                p.observe_draft(drafted, 0.0)
        return steps
    dear = probes(0.009)
    assert {b - a for a, b in zip(dear, dear[1:])} == {62}
    assert probes(0.002)[:5] == [1, 3, 5, 7, 9]


# ---- MoE targets: the step time follows the experts the windows touch ----

from specmoe.spec_decode.routing_overlap import (miss_log, segment_overlap,  # noqa: E402
                                                 unique_fraction, window_experts)


def test_window_experts_and_the_batch_union():
    assert window_experts(1, 64, 8, 0.5) == 8
    assert window_experts(5, 64, 8, 0.5) == 8 + 4 * 4
    assert window_experts(40, 64, 8, 0.0) == 64           # capped at N
    # two independent windows of one token: 1 - (1 - 8/64)^2 of the experts
    assert unique_fraction([1, 1], 64, 8, 0.5) == pytest.approx(1 - (56 / 64) ** 2)
    assert unique_fraction([1], 8, 8, 0.0) == pytest.approx(1.0)


def test_segment_overlap_counts_only_adjacent_tokens_of_one_request():
    import torch
    ids = torch.tensor([[0, 1], [1, 2], [5, 6], [5, 6], [7, 0]])
    # request A: rows 0-1 share expert 1 (1 of 2); request B: rows 2-3 share 2, rows 3-4 none
    assert segment_overlap(ids, [2, 3]) == (3, 6)
    assert segment_overlap(ids, [1, 1, 1, 1, 1]) == (0, 0)


def _moe_step(c0: float, c_u: float, base_rows: int):
    """A memory-bound MoE step: a fixed cost plus c_u x the share of experts touched."""
    return lambda drafts, misses, var=None: c0 + c_u * (1 - np.exp(np.asarray(misses, dtype=float)))


@pytest.mark.parametrize("overlap, deeper", [(0.9, True), (0.0, False)])
def test_moe_drafts_deeper_when_adjacent_tokens_share_experts(overlap, deeper):
    gains = _gains(0.7, 1)
    step = _moe_step(0.002, 0.010, 1)
    miss = miss_log(np.arange(1, 10), 64, 8, overlap)
    ks, rate = choose_ks(gains, np.array([8]), step, 0.0005, miss)
    assert rate == pytest.approx(predicted_rate(ks, gains, step, 0.0005, miss))
    other = miss_log(np.arange(1, 10), 64, 8, 0.9 if overlap == 0.0 else 0.0)
    ks_other, _ = choose_ks(gains, np.array([8]), step, 0.0005, other)
    assert bool(ks[0] > ks_other[0]) is deeper


def test_moe_choice_is_exhaustively_optimal():
    gains = np.stack([np.cumprod(np.full(8, 0.9)), np.cumprod(np.full(8, 0.5))])
    step = _moe_step(0.003, 0.008, 2)
    miss = miss_log(np.arange(1, 10), 32, 4, 0.5)
    ks, _ = choose_ks(gains, np.array([6, 8]), step, 0.0003, miss)
    best = max(predicted_rate(np.array([a, b]), gains, step, 0.0003, miss)
               for a in range(7) for b in range(9))
    assert predicted_rate(ks, gains, step, 0.0003, miss) == pytest.approx(best)


def test_moe_step_time_model_learns_the_expert_term():
    m = StepTimeModel(window=64, min_steps=8, moe=True)
    rng = np.random.default_rng(0)
    for _ in range(32):
        rows, frac = int(rng.integers(1, 40)), float(rng.uniform(0.1, 1.0))
        m.observe(rows, 0.002 + 0.0001 * rows + 0.010 * frac, frac)
    assert m.predict(10, 0.5) == pytest.approx(0.002 + 0.001 + 0.005, rel=1e-3)
    assert m.predict_one(10, 0.5) == pytest.approx(0.002 + 0.001 + 0.005, rel=1e-3)
    assert m.coef[-1] == pytest.approx(0.010, rel=1e-3)


def test_policy_measures_overlap_and_predicts_moe_steps():
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, num_experts=64, top_k=8, min_fit_steps=4))
    assert p.overlap == 0.4
    p.observe_overlap(0.8)
    assert p.overlap == pytest.approx(0.8)  # the first measurement replaces the prior
    assert p.unique_fraction([1]) == pytest.approx(8 / 64)
    dense = AdaptivePolicy(AdaptiveSettings(max_k=4))
    assert dense.unique_fraction([1, 5]) == 0.0


# ---- drafting priced apart from the catch-ups (DraftDepthModel) ----


def _draft_forward(rows):  # a draft forward: 2 ms, and 0.2 ms per row
    return 0.002 + 0.0002 * rows


def _depth_policy(pending_history):
    p = AdaptivePolicy(AdaptiveSettings(max_k=4, probe_every=1000, min_fit_steps=4))
    _calibrated(p, 0.020, 0.0)  # memory-bound target: 20 ms a step whatever its rows
    for rows in pending_history:  # steady calls and a few probes with long catch-ups
        p.observe_draft(1, _draft_forward(rows), catch_ups=[rows])
    for _ in range(40):
        p.observe_verified("a", 1, 1)
    return p


def test_catch_ups_do_not_price_steady_drafting():
    """Probes that caught up 500 tokens made the per-depth mean 35 ms a draft, more than
    a step, so speculation stayed off; priced apart from its catch-up, a caught-up request
    drafts."""
    history = [2, 2, 2, 500, 2, 2, 500, 500]
    p = _depth_policy(history)
    assert p.draft_s > 0.020
    assert p.choose(["a"], [4], 1)["a"] == 0  # catch-ups unknown: the mean
    assert _depth_policy(history).choose(["a"], [4], 1, [2])["a"] > 0


def test_a_resuming_catch_up_is_spread_over_the_horizon():
    history = [2, 2, 2, 2, 500, 500]
    # not drafting before: 3999 / 16 catch-up tokens (50 ms) on this step outweigh its gain
    assert _depth_policy(history).choose(["a"], [4], 1, pending=[4000])["a"] == 0
    assert _depth_policy(history).choose(["a"], [4], 1, pending=[40])["a"] > 0
    # drafting on the previous step: its pending tokens recur every step, in full
    p = _depth_policy(history)
    p._previous = {"a": 1}
    assert _shares(p, [40]) == [39.0]
    assert _shares(_depth_policy(history), [33]) == [2.0]


def _shares(policy, pending, remaining=None):
    """The catch-up tokens beyond the first that `_drafting` charges this step."""
    ids = ["a", "b"][:len(pending)]
    gains = np.stack([policy.acceptance.gains(r) for r in ids])
    return policy._catch_up_shares(ids, gains, np.full(len(pending), 4), pending,
                                   remaining).tolist()


def test_catch_up_priced_choice_predicts_its_own_rate():
    p = _depth_policy([2, 3, 2, 500, 2])
    gains = np.stack([_gains(0.9, 1)[0], _gains(0.6, 1)[0], _gains(0.3, 1)[0]])[:, :4]
    drafting = p._drafting(["x", "y", "z"], gains, np.full(3, 4), [3, 30, 300], None)
    assert "starts" in drafting
    step = p._step_fn(3)
    ks, rate = choose_ks(gains, np.full(3, 4), step, **drafting)
    assert ks.any()
    assert rate == pytest.approx(predicted_rate(ks, gains, step, **drafting))
