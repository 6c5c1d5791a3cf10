"""StatsGather: which rank_stats() calls a gathering answers, and when."""

from __future__ import annotations

import queue

from shardlm.engine.service import StatsGather


def _ask(g: StatsGather) -> queue.Queue:
    box: queue.Queue = queue.Queue()
    g.asks.put(box)
    return box


def test_a_gathering_answers_every_call_pending_at_its_start_once_each_rank_reported():
    g = StatsGather(world=3)
    assert not g.begin() and not g.under_way  # nothing asked: no gathering
    first, second = _ask(g), _ask(g)
    assert g.pending() and g.begin() and g.under_way and not g.pending()
    late = _ask(g)
    assert not g.begin()  # one gathering at a time: the late call waits for the next
    g.take(2, {"r": 2})
    g.take(0, {"r": 0})
    assert first.empty() and g.under_way
    g.take(1, {"r": 1})
    want = [{"r": 0}, {"r": 1}, {"r": 2}]
    assert first.get_nowait() == want and second.get_nowait() == want and late.empty()
    assert not g.under_way and g.pending() and g.begin()
    for r in range(3):
        g.take(r, {"r": r, "again": True})
    assert late.get_nowait()[1] == {"r": 1, "again": True}


def test_counters_with_no_gathering_under_way_are_dropped():
    g = StatsGather(world=2)
    g.take(0, {"stray": True})
    box = _ask(g)
    assert g.begin()
    g.take(0, {"r": 0})
    g.take(1, {"r": 1})
    assert box.get_nowait() == [{"r": 0}, {"r": 1}]
