"""Interleaved A/B timing for the results scripts: every variant once per repetition, the
order rotated each repetition, so that a machine whose speed drifts within minutes (memory
bandwidth phases of tens of percent) spreads its drift over all variants; each variant then
summarised against a baseline by its minimum, its median, and the median of the
per-repetition ratios (the paired median, which cancels the drift the repetition shared)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def rotated(runs: dict[str, Callable[[], object]], reps: int,
            on_rep: Callable[[int, dict[str, float]], None] | None = None
            ) -> dict[str, list[float]]:
    """Wall seconds of each of `runs` (name -> a call that does one run), `reps` times; in
    repetition r the order starts at the r-th name. `on_rep(r, {name: seconds})` is called
    after each repetition (progress). Raises ValueError on reps < 1 or no runs."""
    if reps < 1 or not runs:
        raise ValueError(f"need reps >= 1 and at least one run, got reps={reps}, "
                         f"{len(runs)} runs")
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
        if on_rep is not None:
            on_rep(rep, {n: times[n][-1] for n in names})
    return times


def summary(times: dict[str, list[float]], baseline: str) -> list[str]:
    """One line per variant: min and median seconds, and `baseline`'s time over its own
    (above 1: faster than the baseline) by min, by median and paired (the median of the
    per-repetition ratios). Raises KeyError for a baseline not in `times`."""
    base = times[baseline]
    width = max(map(len, times))
    return [f"{name:{width}s} min {min(t):.3f} med {statistics.median(t):.3f}  "
            f"{baseline}/x min {min(base) / min(t):.3f} med "
            f"{statistics.median(base) / statistics.median(t):.3f} paired-med "
            f"{statistics.median(b / x for b, x in zip(base, t)):.3f}"
            for name, t in times.items()]
