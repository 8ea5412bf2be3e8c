"""`frozen_heap`: the objects alive on entry are left out of collections inside the block
(a full collection no longer walks them), later garbage is still collected, and the heap
is unfrozen on leaving, even after an error."""

from __future__ import annotations

import gc
import weakref

import pytest

from specmoe.utils.gc_heap import frozen_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_heap_is_frozen_inside_the_block_and_unfrozen_after():
    before = _Node()
    alive = weakref.ref(before)
    del before  # a cycle left as garbage before the block: collected on entry
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert alive() is None
        assert gc.get_freeze_count() > 1000  # the interpreter's and pytest's objects
        inside = _Node()
        ref = weakref.ref(inside)
        del inside
        gc.collect()
        assert ref() is None  # garbage made inside the block is collected as before
    assert gc.get_freeze_count() == 0


def test_the_heap_is_unfrozen_when_the_block_raises():
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("a failed run")
    assert gc.get_freeze_count() == 0
