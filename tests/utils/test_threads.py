"""The thread governor runs on the cores other processes leave free, never below one thread
or above the count it started with, and leaves a count the user chose alone."""

from __future__ import annotations

import pytest

from specmoe.utils import threads


class FakeMachine:
    """A clock and CPU-time counters the test advances: `run(seconds, ours, others)` adds
    `ours` and `others` busy cores for that long."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0

    def run(self, seconds: float, ours: float, others: float) -> None:
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds

    def governor(self, calls: list[int], cpus: int = 2, max_threads: int = 2):
        return threads.ThreadGovernor(calls.append, max_threads, interval_s=0.5,
                                      cpus=set(range(cpus)), clock=lambda: self.now,
                                      read_busy=lambda cpus: self.busy,
                                      read_own=lambda: self.own)


@pytest.fixture(autouse=True)
def unpinned(monkeypatch):
    monkeypatch.setattr(threads, "_pinned", False)


def test_a_busy_neighbour_takes_a_core_and_gives_it_back():
    m, calls = FakeMachine(), []
    gov = m.governor(calls)
    m.run(0.6, ours=2.0, others=0.0)
    assert gov.update() == 2 and calls == []
    m.run(0.6, ours=1.33, others=0.67)  # a neighbour gets its share of three threads
    assert gov.update() == 1 and calls == [1]
    m.run(0.6, ours=1.0, others=1.0)
    assert gov.update() == 1 and calls == [1]
    m.run(0.6, ours=1.0, others=0.05)  # the neighbour left
    assert gov.update() == 2 and calls == [1, 2]


def test_estimates_wait_for_a_full_interval_and_skip_stale_windows():
    m, calls = FakeMachine(), []
    gov = m.governor(calls)
    m.run(0.2, ours=1.0, others=1.0)
    assert gov.update() == 2  # too short to judge
    m.run(10.0, ours=0.0, others=1.0)  # idle while someone else ran: not the present
    assert gov.update() == 2 and calls == []
    m.run(0.6, ours=1.0, others=1.0)
    assert gov.update() == 1


def test_never_below_one_nor_above_the_start():
    m, calls = FakeMachine(), []
    gov = m.governor(calls, cpus=8, max_threads=4)
    m.run(0.6, ours=1.0, others=7.9)
    assert gov.update() == 1
    m.run(0.6, ours=1.0, others=0.0)
    assert gov.update() == 4 and calls == [1, 4]


def test_a_pinned_count_is_left_alone():
    m, calls = FakeMachine(), []
    gov = m.governor(calls)
    threads.pin_thread_count()
    m.run(0.6, ours=1.0, others=1.0)
    assert gov.update() == 2 and calls == []


def test_reads_real_cpu_times_here():
    busy = threads.read_cpu_busy_seconds({0})
    assert busy > 0 and threads.own_cpu_seconds() > 0
    assert threads.read_cpu_busy_seconds({0, 1}) >= busy


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECMOE_FIXED_THREADS", "1")
    assert isinstance(threads.make_thread_governor(print, 2), threads.NullThreadGovernor)
    monkeypatch.delenv("SPECMOE_FIXED_THREADS")
    assert isinstance(threads.make_thread_governor(print, 2), threads.ThreadGovernor)


def test_cpu_times_are_read_only_once_an_interval_has_passed():
    m, calls, reads = FakeMachine(), [], []
    gov = threads.ThreadGovernor(calls.append, 2, interval_s=0.5, cpus={0, 1},
                                 clock=lambda: m.now,
                                 read_busy=lambda cpus: reads.append(1) or m.busy,
                                 read_own=lambda: m.own)
    for _ in range(10):  # steps within one interval
        m.run(0.01, ours=2.0, others=0.0)
        gov.update()
    assert len(reads) == 1  # the construction's sample only
    m.run(0.6, ours=2.0, others=0.0)
    gov.update()
    assert len(reads) == 2
