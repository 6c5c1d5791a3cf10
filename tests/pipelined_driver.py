"""The engine's pipelined driver (engine/service.py `Engine._loop`) in one process, against a rank's loop
(runtime/ahead.py `serve_steps`) in a thread: for tests and diagnostics that need the rank in this process (stood-in
replays, patched kernels). Used by tests/unit/test_run_ahead.py and bench/gpu_invariance.py."""

from __future__ import annotations

import queue
import threading
from typing import Callable

from shardlm.engine.requests import Request
from shardlm.engine.scheduler import Scheduler
from shardlm.runtime.ahead import serve_steps


def drive(runner, sched: Scheduler, arrivals: dict[int, list[Request]], tokenizer=None,
          after_apply: Callable[[], None] | None = None, turns: int = 500, wait_s: float = 30.0) -> bool:
    """Add arrivals[t] at turn t of the loop and plan steps as Engine._loop does: step n + 1 is sent before step n's
    result is applied, except that a step under way is applied first when there is prompt work to plan.
    `after_apply` runs after each applied result. Returns whether the rank's loop stopped and every request ended."""
    inbox, outbox = queue.Queue(), queue.Queue()
    loop = threading.Thread(target=serve_steps, args=(runner, inbox, outbox, 0, dict), daemon=True)
    loop.start()

    def apply(step) -> None:
        kind, _, result = outbox.get(timeout=wait_s)
        if kind != "step" or result.id != step.id:
            raise RuntimeError(f"step {step.id}: the rank answered {kind} {getattr(result, 'id', result)}")
        sched.apply(step, result, tokenizer)
        if after_apply is not None:
            after_apply()

    under_way, last = None, max(arrivals, default=0)
    for turn in range(turns):
        for r in arrivals.get(turn, ()):
            sched.add(r)
        if under_way is not None and sched.prompt_work():  # plan prompts on the latest results
            apply(under_way)
            under_way = None
        step = sched.next_step()
        if step.empty:
            if under_way is not None:
                apply(under_way)
                under_way = None
            elif turn >= last and sched.idle():
                break
            continue
        inbox.put(step)
        if under_way is not None:
            apply(under_way)
        under_way = step
    inbox.put(None)
    loop.join(timeout=wait_s)
    return not loop.is_alive() and sched.idle()
