"""A rank's inbox (engine/ranks.py Inbox): messages written by the sending thread, read in order by a spawned
process, a timeout named as queue.Empty, and only the reading end handed to the rank."""

import multiprocessing as mp
import pickle
import queue
import threading
import time

import pytest

from shardlm.engine.ranks import Inbox


def _echo(inbox, outbox) -> None:
    """In the child: return every message until None."""
    while True:
        msg = inbox.get(timeout=30)
        if msg is None:
            return
        outbox.put(msg)


def test_messages_reach_a_spawned_process_in_order():
    ctx = mp.get_context("spawn")
    inbox, outbox = Inbox(ctx), ctx.Queue()
    child = ctx.Process(target=_echo, args=(inbox, outbox), daemon=True)
    child.start()
    try:
        big = list(range(100_000))  # larger than a pipe's buffer: the sender waits until the child reads
        sent = [("step", i, {"tokens": [i] * 3}) for i in range(50)] + [big]
        for m in sent:
            inbox.put(m)
        got = [outbox.get(timeout=30) for _ in sent]
        assert got == sent
        inbox.put(None)
        child.join(timeout=30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


def test_get_times_out_with_queue_empty_and_senders_share_the_pipe():
    inbox = Inbox(mp.get_context("spawn"))
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.05)
    assert time.monotonic() - t0 >= 0.04
    threads = [threading.Thread(target=lambda k=k: [inbox.put((k, i)) for i in range(200)]) for k in range(4)]
    for t in threads:
        t.start()
    got = [inbox.get(timeout=10) for _ in range(800)]
    for t in threads:
        t.join(timeout=10)
    for k in range(4):  # whole messages, each sender's in its own order
        assert [i for kk, i in got if kk == k] == list(range(200))


def test_a_rank_gets_the_reading_end_only():
    state = Inbox(mp.get_context("spawn")).__getstate__()
    assert state["_writer"] is None and state["_lock"] is None and state["_reader"] is not None
    with pytest.raises(TypeError):
        pickle.dumps(threading.Lock())  # why the lock stays behind
