"""One log format for the driver and every rank process: who speaks is in every line.

    12:04:31.207 [rank 3 stage 1 tp 1] INFO shardlm.runtime.build: built layers 15-29 in 0.41 s ...
    12:04:31.950 [driver] INFO shardlm.engine.engine: 4 ranks ready in 2.3 s

The driver calls `setup(level, "driver")` when a command starts; each rank calls it with
`rank_label(spec)` before it does anything else, at the level the driver sends in its launch message.
"""

from __future__ import annotations

import logging
import sys

DATE_FORMAT = "%H:%M:%S"


def rank_label(rank: int, stage: int, tp_rank: int) -> str:
    """How a rank names itself in its log lines: "rank 3 stage 1 tp 1"."""
    return f"rank {rank} stage {stage} tp {tp_rank}"


def setup(level: str | int, who: str) -> None:
    """Send this process's log lines to stderr in the shared format, tagged with `who`."""
    handler = logging.StreamHandler(sys.stderr)
    safe = who.replace("%", "%%")
    handler.setFormatter(logging.Formatter(f"%(asctime)s.%(msecs)03d [{safe}] %(levelname)s %(name)s: %(message)s",
                                           DATE_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
