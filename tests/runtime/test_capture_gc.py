"""A decode-graph capture runs with Python's garbage collector off (collected once before): a
collection during a capture could free an unreachable model's CUDA graphs, and destroying a graph
while a stream captures invalidates the capture (seen on the H200 with torch 2.11)."""

from __future__ import annotations

import gc

from mxc.runtime.graph_capture import _no_collection


class _Cycle:
    freed = []

    def __init__(self):
        self.me = self

    def __del__(self):
        _Cycle.freed.append(gc.isenabled())


def test_collects_before_and_not_during():
    _Cycle()  # unreachable, held only by its own cycle: freed only by a collection
    assert gc.isenabled()
    with _no_collection():
        assert _Cycle.freed == [True]  # collected on entry, before the capture starts
        assert not gc.isenabled()
        _Cycle()
    assert gc.isenabled() and _Cycle.freed == [True]
    gc.collect()
    assert len(_Cycle.freed) == 2


def test_leaves_a_disabled_collector_disabled():
    gc.disable()
    try:
        with _no_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
