"""Keep the cyclic garbage collector's pauses out of engine steps (gc.freeze).

A loaded engine holds ~320 thousand objects the collector tracks (torch, transformers and
scipy's modules and functions, the engine, its KV-cache blocks). Each collection of the
oldest generation walks all of them: 140 ms on tiny-moe with its draft on a 2-core EPYC,
and one lands inside an engine step every few thousand steps (a 0.6 ms tiny-moe step
stalled for 0.23 s, 3-4% of a 6 s benchmark run, more often where the engine allocates
more per step). A server or benchmark keeps those objects while it runs, so once they
are built they are moved to the permanent generation, which collections skip (the
same collection then takes 0.0 ms), as vLLM's engine core does at start-up. Objects
created later are collected as before, and a frozen object that becomes garbage is still
freed by reference counting; the heap is unfrozen on leaving, so that frozen reference
cycles are collected again in a process that goes on (the tests build many engines).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect start-up's garbage, then freeze every object alive now (gc.freeze) until
    the block ends (gc.unfreeze)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
