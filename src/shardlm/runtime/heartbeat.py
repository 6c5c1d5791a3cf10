"""Liveness of a rank process: a thread stamps the clock into shared memory every HEARTBEAT_S.

The driver reads the stamps (engine/ranks.py): a rank whose stamp stops moving for longer than its
deadline is hung (stopped with SIGSTOP, wedged in a driver call, starved) even though its process
exists, and it is named and every rank is stopped. A rank blocked in a collective because a peer is
stuck keeps stamping: the stuck peer is the one named. Idle waits need no deadline of their own.
"""

from __future__ import annotations

import threading
import time

HEARTBEAT_S = 0.5
"""Seconds between stamps."""


def start_heartbeat(stamps, rank: int) -> threading.Thread:
    """Stamp time.monotonic() (one clock for every process of the machine) into stamps[rank], forever."""

    def beat() -> None:
        while True:
            stamps[rank] = time.monotonic()
            time.sleep(HEARTBEAT_S)

    thread = threading.Thread(target=beat, name=f"shardlm-heartbeat-{rank}", daemon=True)
    thread.start()
    return thread
