"""Progress of long one-time work, shown while it runs: loading weights (tensors and bytes),
building a native kernel, packing weights, timing the one-row prefetch. The work reports to
`current()`, silent unless a command line installed a reporter with `reporting(...)` (as
`specmoe generate` and `specmoe serve` do with `StderrProgress`)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")


class Progress:
    """The silent reporter (the default): every call passes its work through."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Around one piece of work, e.g. "building native kernel gemv_bf16.c"."""
        yield

    def items(self, iterable: Iterable[T], name: str,
              size: Callable[[T], int] = lambda _: 0) -> Iterator[T]:
        """`iterable` unchanged, counted (and `size(item)` bytes summed) as it is consumed."""
        yield from iterable


class StderrProgress(Progress):
    """Lines on `stream` (stderr): a phase's name when it starts and its seconds when it ends;
    counted items redrawn in place at most every `interval_s` on a terminal, their totals
    once at the end elsewhere (logs stay short). Phases may nest (a kernel build inside
    packing): each writes whole lines."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = 0.25) -> None:
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.is_tty = self.stream.isatty()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self._write(f"specmoe: {name} ...\n")
        yield
        self._write(f"specmoe: {name}: done in {time.perf_counter() - start:.1f} s\n")

    def items(self, iterable: Iterable[T], name: str,
              size: Callable[[T], int] = lambda _: 0) -> Iterator[T]:
        start = last = time.perf_counter()
        count = nbytes = 0
        for item in iterable:
            yield item
            count, nbytes = count + 1, nbytes + size(item)
            now = time.perf_counter()
            if self.is_tty and now - last >= self.interval_s:
                last = now
                self._write(f"\rspecmoe: {name}: {_counted(count, nbytes, now - start)}")
        line = f"specmoe: {name}: {_counted(count, nbytes, time.perf_counter() - start)}\n"
        self._write(("\r" if self.is_tty else "") + line)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def _counted(count: int, nbytes: int, seconds: float) -> str:
    return f"{count} tensors, {nbytes / 1e9:.2f} GB, {seconds:.1f} s"


_current: Progress = Progress()


def current() -> Progress:
    """The reporter long work reports to (silent unless `reporting` installed one)."""
    return _current


@contextlib.contextmanager
def reporting(progress: Progress) -> Iterator[Progress]:
    """Install `progress` as `current()` for the block (the previous one after it)."""
    global _current
    previous, _current = _current, progress
    try:
        yield progress
    finally:
        _current = previous
