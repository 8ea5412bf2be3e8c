"""Intra-op threads that follow the cores other processes leave free (L1: no torch).

torch's CPU wheel and specmoe's C kernels share one OpenMP runtime, GNU libgomp, whose idle
threads spin for milliseconds after each parallel region before they sleep. On a quiet
machine one thread per core is fastest. With another CPU-bound process on the same cores,
each parallel region waits at its closing barrier for a thread the scheduler has parked,
while its spinning siblings burn the time slices the parked one needs, and decoding slows
several-fold (`bench/bench_threads.py` measures it). A lower spin count (GOMP_SPINCOUNT) or
OMP_WAIT_POLICY=passive softens this, but slows a quiet machine, where every wake-up then
pays the futex round trip.

So the engine asks a `ThreadGovernor` before each step: from /proc/stat (CPU time spent on
the cores this process may use) minus this process's own CPU time, it estimates how many
cores other processes keep busy, and runs on the cores left, at least one and at most the
count it started with. The estimate is refreshed at most every `interval_s`, from the CPU
time of the last interval only (a longer gap, such as an idle server's, starts a new
window). A count the user chose (`pin_thread_count`, which `--threads` calls) is never
changed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

_pinned = False
STALE_WINDOWS = 4  # a window this many intervals long says little about the present


def pin_thread_count() -> None:
    """Stop every governor from changing the thread count (the user chose it)."""
    global _pinned
    _pinned = True


def is_thread_count_pinned() -> bool:
    return _pinned


def read_cpu_busy_seconds(cpus: set[int], path: str = "/proc/stat") -> float:
    """Seconds the given CPUs spent not idle since boot, over all processes (user, nice,
    system, irq, softirq and steal: time a guest's core was given to someone else).

    Raises:
        OSError: no /proc/stat (not Linux).
    """
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    with open(path) as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            if int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                busy += user + nice + system + irq + softirq + steal
    return busy / tick


def own_cpu_seconds() -> float:
    """CPU seconds this process has used, all its threads together."""
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """Picks the thread count for the next step from the cores other processes use.

    Args:
        set_threads: sets the intra-op thread count (torch.set_num_threads).
        max_threads: the most threads to use (the count in force when the engine started).
        interval_s: seconds between two estimates.
        cpus: the CPUs this process may run on (default: its affinity mask).
        clock, read_busy, read_own: time sources (monotonic seconds; busy seconds of `cpus`;
            this process's CPU seconds), replaceable in tests.

    Raises:
        OSError: the CPU times cannot be read (not Linux); use `NullThreadGovernor` then.
    """

    def __init__(self, set_threads: Callable[[int], None], max_threads: int,
                 interval_s: float = 0.5, cpus: set[int] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 read_busy: Callable[[set[int]], float] = read_cpu_busy_seconds,
                 read_own: Callable[[], float] = own_cpu_seconds) -> None:
        self.set_threads = set_threads
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self.interval_s = interval_s
        self.cpus = cpus if cpus is not None else set(os.sched_getaffinity(0))
        self.clock, self.read_busy, self.read_own = clock, read_busy, read_own
        self.others_cores = 0.0
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        return self.clock(), self.read_busy(self.cpus), self.read_own()

    def update(self) -> int:
        """Re-estimate if `interval_s` has passed, set the thread count if it changed, and
        return it."""
        if is_thread_count_pinned():
            return self.threads
        if self.clock() - self._last[0] < self.interval_s:  # the common case: no file read
            return self.threads
        now = self._sample()
        wall = now[0] - self._last[0]
        if wall > STALE_WINDOWS * self.interval_s:  # after idling: others' past, not now
            self._last = now
            return self.threads
        others = (now[1] - self._last[1]) - (now[2] - self._last[2])
        self.others_cores = max(0.0, others / wall)
        self._last = now
        free = len(self.cpus) - self.others_cores
        threads = min(self.max_threads, max(1, int(free + 0.5)))
        if threads != self.threads:
            self.threads = threads
            self.set_threads(threads)
        return threads


class NullThreadGovernor:
    """A governor that never changes anything (no /proc/stat, or switched off)."""

    def update(self) -> int | None:
        return None


def make_thread_governor(set_threads: Callable[[int], None], max_threads: int,
                         fixed: bool | None = None) -> ThreadGovernor | NullThreadGovernor:
    """A `ThreadGovernor`, or a `NullThreadGovernor` where CPU times cannot be read or
    `fixed` asks for the count to stay as it is (`KernelConfig.fixed_threads`; None:
    SPECMOE_FIXED_THREADS=1 does)."""
    from specmoe.utils.env import env_flag
    if fixed if fixed is not None else env_flag("SPECMOE_FIXED_THREADS"):
        return NullThreadGovernor()
    try:
        return ThreadGovernor(set_threads, max_threads)
    except (OSError, ValueError, AttributeError):
        return NullThreadGovernor()
