"""The interleaved A/B timing helper (`specmoe.bench.ab`)."""

from __future__ import annotations

import pytest

from specmoe.bench.ab import rotated, summary


def test_rotated_runs_every_variant_each_repetition_in_rotated_order():
    order, progress = [], []
    runs = {n: (lambda n=n: order.append(n)) for n in "abc"}
    times = rotated(runs, 4, lambda rep, t: progress.append((rep, sorted(t))))
    assert order == list("abc" "bca" "cab" "abc")
    assert [len(t) for t in times.values()] == [4, 4, 4]
    assert all(s >= 0 for t in times.values() for s in t)
    assert progress == [(r, ["a", "b", "c"]) for r in range(4)]


def test_rotated_rejects_no_repetitions_or_no_runs():
    with pytest.raises(ValueError, match="reps=0"):
        rotated({"a": lambda: None}, 0)
    with pytest.raises(ValueError, match="0 runs"):
        rotated({}, 2)


def test_summary_ratios_against_the_baseline():
    lines = summary({"base": [2.0, 4.0, 3.0], "fast": [1.0, 4.0, 1.0]}, "base")
    assert lines[0] == "base min 2.000 med 3.000  base/x min 1.000 med 1.000 paired-med 1.000"
    # min 2 / 1, median 3 / 1, per-repetition ratios 2, 1, 3 -> 2
    assert lines[1] == "fast min 1.000 med 1.000  base/x min 2.000 med 3.000 paired-med 2.000"
    with pytest.raises(KeyError):
        summary({"a": [1.0]}, "b")
