"""Prompt lookup's rows vary from step to step (a request fills all its slots where a match
runs on, none where there is no match), and a step's time bends upwards once its rows pass
a knee: the adaptive policy prices a step at its expected time, not at the time of its
expected rows. Checked against exact enumeration of the fill outcomes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from specmoe.spec_decode.choice import _row_variance, choose_ks, predicted_rate
from specmoe.spec_decode.time_models import StepTimeModel


def _fill_distribution(fills: np.ndarray, k: int) -> np.ndarray:
    """[k + 1]: P(m = i) of the filled slots m among the first k, P(m > j) = fills[j]."""
    tail = np.concatenate([[1.0], fills[:k], [0.0]])
    return tail[:-1] - tail[1:]


@pytest.mark.parametrize("fills", [[1.0, 1.0, 1.0], [0.5] * 6, [0.9, 0.6, 0.6, 0.2, 0.1]])
def test_row_variance_adds_up_to_the_variance_of_the_filled_slots(fills):
    f = np.array([fills])
    for k in range(1, f.shape[1] + 1):
        p = _fill_distribution(f[0], k)
        m = np.arange(k + 1)
        exact = (p * m * m).sum() - (p * m).sum() ** 2
        assert _row_variance(f)[0, :k].sum() == pytest.approx(exact, abs=1e-12)


def _knee_model() -> StepTimeModel:
    """Flat to 8 rows, then 0.5 ms a row (SmolLM2-135M in bf16 at two requests)."""
    m = StepTimeModel(window=64, min_steps=8)
    for rows in [1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 24, 2, 2]:
        m.observe(rows, 0.010 + 0.0005 * max(0, rows - 8))
    return m


def test_expected_step_time_is_the_mean_over_the_rows():
    m = _knee_model()
    # rows 2 or 18 with equal chance: mean 10 rows, but half the steps pay 10 rows' slope
    exact = 0.5 * (float(m.predict(2)) + float(m.predict(18)))
    assert float(m.predict(10)) < exact
    # the normal approximation of the two-point rows is closer than the plug-in
    approx = float(m.predict(10, var=64.0))
    assert abs(approx - exact) < 0.5 * abs(float(m.predict(10)) - exact)
    assert float(m.predict(10, var=0.0)) == pytest.approx(float(m.predict(10)))


def _exact_rate(ks: np.ndarray, gains: np.ndarray, fills: np.ndarray, model: StepTimeModel,
                base: int) -> float:
    """E[tokens] / E[seconds], the seconds averaged over every fill outcome."""
    dists = [_fill_distribution(f, k) for f, k in zip(fills, ks)]
    seconds = 0.0
    for outcome in itertools.product(*(range(len(d)) for d in dists)):
        p = np.prod([d[i] for d, i in zip(dists, outcome)])
        seconds += p * float(model.predict(base + sum(outcome)))
    return (len(ks) + sum(g[:k].sum() for g, k in zip(gains, ks))) / seconds


def test_all_or_nothing_matches_draft_shallower_than_their_mean_rows_suggest():
    """Two requests whose proposals fill all their slots or none, half the time each,
    each draft accepted half the time: at K = 6 each the mean is 8 rows, where the model is
    still flat, but a quarter of the steps run 14. Priced at the mean rows, K = 6 looks
    free; at the mean time it is not, and the variance-aware choice is faster on the exact
    expectation."""
    model, base = _knee_model(), 2
    fills = np.full((2, 8), 0.5)
    gains = fills * np.cumprod(np.full((2, 8), 0.5), axis=1)

    def plug_in(drafts, misses, var=None):
        return model.predict(base + drafts)

    def expected(drafts, misses, var=None):
        return model.predict(base + drafts, var=var)
    naive, _ = choose_ks(gains, np.full(2, 8), plug_in, 0.0, fills=fills)
    aware, rate = choose_ks(gains, np.full(2, 8), expected, 0.0, fills=fills)
    assert rate == pytest.approx(predicted_rate(aware, gains, expected, 0.0, fills=fills))
    assert aware.sum() < naive.sum()
    assert (_exact_rate(aware, gains, fills, model, base)
            > _exact_rate(naive, gains, fills, model, base))


def test_choice_predicts_its_own_rate_on_random_inputs():
    """The search's prefix sums (rows, variance, experts) and `predicted_rate` agree on
    whatever the search picks."""
    rng = np.random.default_rng(7)
    model = _knee_model()
    for _ in range(200):
        b, k = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        fills = np.minimum.accumulate(rng.uniform(0.05, 1.0, (b, k)), axis=1)
        gains = fills * np.cumprod(rng.uniform(0.2, 1.0, (b, k)), axis=1)
        caps = rng.integers(0, k + 1, b)

        def step(drafts, misses, var=None, base=b):
            return model.predict(base + drafts, var=var)
        ks, rate = choose_ks(gains, caps, step, 0.0003, fills=fills)
        assert (ks <= caps).all()
        assert rate == pytest.approx(predicted_rate(ks, gains, step, 0.0003, fills=fills))


def test_every_allowed_draft_filled_is_exhaustively_optimal():
    """Without fills the rows are known: the search (all depths at once) finds the best K
    vector of every one tried."""
    rng = np.random.default_rng(3)
    model = _knee_model()
    for _ in range(40):
        b, k = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        gains = np.cumprod(rng.uniform(0.1, 1.0, (b, k)), axis=1)
        caps = rng.integers(0, k + 1, b)

        def step(drafts, misses, var=None, base=b):
            return model.predict(base + drafts)
        ks, rate = choose_ks(gains, caps, step, 0.0004)
        best = max(predicted_rate(np.array(v), gains, step, 0.0004)
                   for v in itertools.product(*(range(c + 1) for c in caps)))
        assert rate == pytest.approx(best)
