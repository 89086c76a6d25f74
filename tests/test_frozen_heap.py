"""planner.core.frozen_heap: the old heap frozen while a body runs and handed back after; the collector
paused and restored as it was, also when the body raises."""

from __future__ import annotations

import gc
import weakref

import pytest

from planner.core.frozen_heap import collector_paused, frozen_heap


def test_frozen_heap_freezes_what_exists_and_hands_it_back():
    assert gc.get_freeze_count() == 0
    kept = [object() for _ in range(10)]
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        with frozen_heap():                      # nested: nothing changes
            assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    assert kept


def test_collector_paused_restores_the_collector_as_it_was():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("body failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()                # it was off before: it stays off
    finally:
        gc.enable()


def test_cycles_made_while_paused_are_collected_after():
    class Node:
        def __init__(self) -> None:
            self.other: Node | None = None

    with collector_paused():
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
        for _ in range(10_000):                   # allocations that would trigger collections
            _ = [object()]
        assert alive() is not None                # a cycle: only the collector frees it
    gc.collect()
    assert alive() is None
