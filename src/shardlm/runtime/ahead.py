"""Greedy decode steps of a one-GPU serving rank, launched before the step ahead of them is read back.

With pipelined steps (engine/scheduler.py) the driver sends step n + 1 before it has step n's result, and a decode
row whose token the driver has not seen yet says so (`Decode.token` None). A rank that reads step n's tokens back
before it builds step n + 1 leaves its GPU idle while its host does that work: on an H200 the engine's Llama-3.2-1B
step took 1.98-2.09 ms against 1.64 ms for the replay alone (bench/RESULTS.md, 2026-11-26). Here a step whose rows
all decode greedily is launched (inputs staged, its CUDA graph replayed, each row's argmax taken on the GPU and
copied back behind an event) and read later: `serve_steps` launches step n + 1, whose rows with a token still on
the GPU take it from `held` (each slot's last launched argmax), and only then reads step n. A row gets the tokens
it would get read at once: the same replay fed the same token, and a row's argmax is its own.

Inputs go in through the graphs' pinned staging (SlotGraphs.stage), tokens come back through pinned buffers used in
turn: at most two launched steps are unread at a time and they are read in order (step n right after step n + 1 is
launched), so a buffer is written again only after the step that used it has been read.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass

import torch

from shardlm.runtime.work import Sampled, Step, StepResult

POLL_S = 0.0002
"""While a launched step is unread, how long one wait for the driver's next message lasts before the rank checks
whether the GPU has finished that step (and then reads it rather than wait on). A driver that waits for each result
before sending the next step (an Engine with pipelined=False) gets it up to this much later."""

_NOTHING = object()


@dataclass
class Launched:
    """A step launched on the GPU and not read back yet."""

    step: Step
    slots: list[int]
    tokens: torch.Tensor
    """(slots,) long on the host (pinned on a GPU): row i's argmax is slot i's token once `ready` has passed."""
    ready: torch.cuda.Event | None
    """Recorded after the copy back; None where the step ran synchronously (a CPU stand-in)."""
    t0: float

    def done(self) -> bool:
        """The device has finished the step: reading it will not wait."""
        return self.ready is None or self.ready.query()


class RunAhead:
    """Launching and reading greedy decode steps of one serving rank whose decode steps replay as CUDA graphs
    (runner.graphs, runtime/slot_graphs.py)."""

    def __init__(self, runner):
        graphs = runner.graphs
        n, dev = graphs.cache.slots, graphs.cache.device
        self.runner, self.graphs = runner, graphs
        self.cuda = dev.type == "cuda"
        self.held = torch.zeros(n, dtype=torch.long, device=dev)
        """Each slot's token from the last step launched for it."""
        self.outputs = [torch.zeros(n, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self.latest: dict[int, int] = {}
        """slot -> the id of the last launched step that decoded it, while that step is unread."""
        self.unread: list[int] = []
        """Ids of the launched steps not read yet, oldest first."""
        self.last_read = 0.0
        self.launches = 0
        self.overlapped = 0
        """Launches made while another step was unread (the GPU had work queued)."""

    def counts(self) -> dict[str, int]:
        """Steps launched ahead so far, and of those the ones launched while another was unread (for /metrics)."""
        return {"launched": self.launches, "overlapped": self.overlapped}

    def accepts(self, step: Step) -> bool:
        """Whether `step` can run ahead: decode rows only, all greedy without logprobs, no counters asked for, on
        the rank that reports tokens, with graphs that have not failed."""
        return (not step.starts and not step.prefills and not step.copies and bool(step.decodes)
                and not step.report_stats and step.repeat == 1
                and self.runner.reports and not self.graphs.failed
                and all(d.params.temperature == 0 and d.logprobs is None for d in step.decodes))

    @torch.inference_mode()
    def launch(self, step: Step) -> Launched | None:
        """Replay `step` and take its rows' argmax on the device without reading them; None when its graph could
        not be captured (the caller then reads what is unread and runs the step eagerly)."""
        if len(self.unread) > 1:
            raise RuntimeError(f"{len(self.unread)} launched steps are unread; read one before launching another")
        t0, graphs = time.perf_counter(), self.graphs
        slots, positions = [d.slot for d in step.decodes], [d.position for d in step.decodes]
        tokens = [None if d.token is None and d.slot in self.latest else self.runner.fed_token(d)
                  for d in step.decodes]  # None: still on the device, in `held`
        rows, length = graphs.shape(slots, positions)
        inputs = graphs.stage(rows, slots, positions, tokens, self.held)  # (4, rows)
        got = graphs._graph(rows, length)
        if got is None:
            return None
        graph, logits = got
        graph.replay()
        best = logits[:, 0].argmax(dim=-1)  # (rows,): each row's greedy token
        self.held[:rows] = torch.where(inputs[3].bool(), best, self.held[:rows])
        out = self.outputs[self.launches % 2]
        out[:rows].copy_(best, non_blocking=True)
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        self.latest.update((s, step.id) for s in slots)
        self.overlapped += bool(self.unread)
        self.unread.append(step.id)
        self.launches += 1
        return Launched(step, slots, out, ready, t0)

    def read(self, launched: Launched) -> StepResult:
        """Wait for a launched step and return its result (its slots' tokens become the rank's last samples). Steps
        are read in the order they were launched. A step's time runs from its launch, or from the read of the step
        before it when that came later, to its read: the times of overlapping steps add up to the wall time."""
        if not self.unread or self.unread[0] != launched.step.id:
            raise RuntimeError(f"step {launched.step.id} read out of order (unread: {self.unread})")
        if launched.ready is not None:
            launched.ready.synchronize()
        tokens = launched.tokens.tolist()
        out = {}
        for s in launched.slots:
            out[s] = Sampled(token=tokens[s])
            self.runner.sampled[s] = tokens[s]
            if self.latest.get(s) == launched.step.id:
                del self.latest[s]
        self.unread.pop(0)
        now = time.perf_counter()
        seconds, self.last_read = now - max(launched.t0, self.last_read), now
        self.runner.clock.add(seconds)
        return StepResult(launched.step.id, out, seconds)


def serve_steps(runner, inbox, outbox, rank: int, stats) -> None:
    """A serving rank's loop until the driver sends None: run each Step and put ("step", rank, result) in `outbox`
    (results in the order of the steps); answer "stats" and steps that ask for counters with ("stats", rank,
    stats()). Greedy decode steps of a rank with CUDA-graph decode run ahead (see the module docstring)."""
    ahead, unread = runner.ahead, None
    while True:
        msg = inbox.get() if unread is None else _next_or_nothing(inbox, unread)
        if msg is _NOTHING:  # the GPU finished the unread step and the driver has sent nothing new
            outbox.put(("step", rank, ahead.read(unread)))
            unread = None
            continue
        if isinstance(msg, Step) and ahead is not None and ahead.accepts(msg):
            launched = ahead.launch(msg)
            if launched is not None:
                if unread is not None:
                    outbox.put(("step", rank, ahead.read(unread)))
                unread = launched
                continue
        if unread is not None:
            outbox.put(("step", rank, ahead.read(unread)))
            unread = None
        if msg is None:
            return
        if msg == "stats":
            outbox.put(("stats", rank, stats()))
            continue
        result = runner.run(msg)
        if result is not None:
            outbox.put(("step", rank, result))
        if msg.report_stats:  # after the result, so the driver is not kept waiting for it
            outbox.put(("stats", rank, stats()))


def _next_or_nothing(inbox, unread: Launched):
    """The driver's next message, or _NOTHING once the unread step is done on the device and none has come."""
    while True:
        try:
            return inbox.get(timeout=POLL_S)
        except queue.Empty:
            if unread.done():
                return _NOTHING
