"""Engine: a long-lived sharded model that serves requests with continuous batching.

    with Engine(plan, source) as engine:                 # ranks start once, load, and stay up
        req = engine.submit("The capital of France is", GenerationParams(max_tokens=8, temperature=0))
        for event in engine.stream(req):                 # or: async for event in engine.astream(req)
            print(event.text, end="")

A scheduler thread on the driver runs steps: at every step boundary it admits waiting requests into
free KV-cache slots and retires finished ones (scheduler.py), hands the step to every rank and applies
what they sampled. Requests are validated at submission against the Plan's KV budget and the queue
limit; a rank that fails, dies or hangs ends every request with an error naming it (ranks.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator

from shardlm.engine.ranks import RankFailure, RankGroup
from shardlm.engine.requests import GenerationParams, Request, RequestError, TokenEvent
from shardlm.engine.scheduler import Scheduler
from shardlm.engine.text import has_tokenizer, load_tokenizer
from shardlm.models.source import ModelSource
from shardlm.plan.plan import Plan
from shardlm.settings import Settings

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests wait than the engine's queue limit (an HTTP server answers 429)."""


class EngineClosed(RuntimeError):
    """The engine is stopping or has stopped (a failed rank, or close()); `reason` says which."""


@dataclass
class EngineStats:
    """What the engine is doing now, and has done."""

    running: int
    waiting: int
    slots: int
    steps: int
    finished: dict[str, int]
    healthy: bool
    reason: str


def prefill_alone(ready: list[dict]) -> bool:
    """Whether every rank (by its ready report) runs each prompt chunk in a pass of its own: then the scheduler
    anchors chunks, so that each is its prompt's own (engine/scheduler.py)."""
    return bool(ready) and all(r.get("prefill_alone", False) for r in ready)


class Engine:
    """Ranks of a Plan, started once, serving requests (see the module docstring)."""

    def __init__(self, plan: Plan, source: ModelSource, settings: Settings | None = None, max_queue: int = 1024,
                 threads: int | None = None, shm: bool = True, timeout_s: float | None = None, tokenizer=None,
                 pipelined: bool | None = None, decode_run: int = 1):
        self.plan, self.source, self.max_queue = plan, source, max_queue
        self.pipelined = (plan.device == "cuda" if pipelined is None else pipelined) and plan.layout.pp == 1
        """Send step n + 1 before applying step n's result (scheduler.py): the ranks keep each slot's sampled token
        for it. Not with pipeline stages (the last stage samples, the first embeds). It pays where the driver has
        little to do per step: `generate` (LocalEngine, on by default) decoded 1.00-1.05x as fast on a 2-core host
        (bench/decode_vs_commit.py); a server streaming tokens over HTTP on that host was slower with it (its
        per-token work then competes with CPU ranks for the cores), so by default (`pipelined` None) it is on only
        for GPU ranks, whose steps leave the host's cores free: there the driver's work would otherwise add to every
        step (the engine on an H200 took ~0.4 ms a step beyond its replay even pipelined, bench/RESULTS.md)."""
        if decode_run < 1:
            raise ValueError(f"decode_run is {decode_run}; a step decodes at least 1 token a row")
        self.decode_run = decode_run if plan.layout.pp == 1 else 1
        """Decode tokens a row one step may run when no prompt waits (Scheduler.decode_run): the ranks feed each
        row its own samples in between, so the tokens are the same, with one message each way per run instead of
        per token. Tokens then reach the client in bursts and a new request waits for the run under way, so the
        default is 1 (a server); LocalEngine (`generate`) uses more on CPU ranks. Not with pipeline stages."""
        self.settings = settings or Settings.from_env()
        self.group = RankGroup(plan, source, self.settings, threads, shm,
                               timeout_s or self.settings.collective_timeout_s)
        self.tokenizer = tokenizer
        kv = plan.kv
        self.scheduler = Scheduler(kv.max_batch, kv.max_seq_len, kv.prefill_chunk, source.args.eos_token_ids,
                                   decode_run=self.decode_run)
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._gather = StatsGather(self.group.world)
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: RankFailure | None = None
        self.started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Engine":
        """Spawn and load the ranks, then start the scheduler thread."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the rank processes; from the main thread (see RankGroup.spawn)."""
        self.group.spawn()

    def wait_ready(self) -> "Engine":
        """Wait for the spawned ranks to load, then start scheduling (any thread may call it)."""
        if self.tokenizer is None and has_tokenizer(Path(self.source.folder)):
            self.tokenizer = load_tokenizer(Path(self.source.folder))  # token-id prompts need none
        self.group.wait_ready()
        self.scheduler.anchored = prefill_alone(self.group.ready)
        self._thread = threading.Thread(target=self._loop, name="shardlm-scheduler", daemon=True)
        self._thread.start()
        self.started = True
        return self

    def close(self, drain_s: float = 0.0, force: bool = False) -> None:
        """Stop admitting; let running requests finish for up to `drain_s` seconds, cancel the rest, stop the
        ranks. `force` (an interrupt, an error in the caller) stops the ranks at once."""
        if force:
            self._closing_admission = True
            self._closing.set()
            self.group.stop(force=True)
        deadline = time.monotonic() + drain_s
        self._closing_admission = True
        while drain_s and time.monotonic() < deadline and not self._drained() and self.failure is None:
            time.sleep(0.05)
        self._closing.set()  # the scheduler thread cancels what is left, then exits
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.group.stop(force=self.failure is not None)

    def stop_admitting(self) -> None:
        """Refuse new requests from now on (EngineClosed; a server answers 503); running ones go on."""
        self._closing_admission = True

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close(force=exc[0] is not None)

    # ------------------------------------------------------------------ requests

    def submit(self, prompt: str | list[int], params: GenerationParams | None = None,
               request_id: str | None = None, sink: queue.Queue | None = None) -> Request:
        """Queue a request: a prompt (text, tokenized here) or its token ids. RequestError for a parameter
        outside its range or a prompt the KV budget cannot hold; QueueFull; EngineClosed."""
        if self.failure is not None or getattr(self, "_closing_admission", False) or not self.started:
            raise EngineClosed(self.health()[1])
        params = params or GenerationParams()
        kv = self.plan.kv
        params.validate(kv.max_seq_len)
        if (isinstance(prompt, str) or params.stop) and self.tokenizer is None:
            raise RequestError("prompt" if isinstance(prompt, str) else "stop",
                               f"{self.source.folder} has no tokenizer files, so text prompts and stop strings "
                               "cannot be used; send token ids, or copy the model's tokenizer into that folder")
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt", "the prompt is empty; give at least one token")
        vocab = self.source.args.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise RequestError("prompt", f"prompt token ids must be integers in 0..{vocab - 1}")
        if len(ids) >= kv.max_seq_len:
            raise RequestError("prompt", f"the prompt has {len(ids)} tokens but the engine holds {kv.max_seq_len} "
                                         "tokens per sequence (kv_cache.max_seq_len), generated ones included; "
                                         "shorten the prompt, or serve with a larger --max-seq-len")
        if len(ids) + params.max_tokens > kv.max_seq_len:
            raise RequestError("max_tokens", f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                                             f"{len(ids) + params.max_tokens} in all, but the engine holds "
                                             f"{kv.max_seq_len} tokens per sequence (kv_cache.max_seq_len); "
                                             "shorten the prompt or lower max_tokens")
        if self._inbox.qsize() + len(self.scheduler.waiting) >= self.max_queue:
            raise QueueFull(f"{self.max_queue} requests are already waiting (--max-queue); retry later")
        req = Request(ids, params, sink=sink, **({"id": request_id} if request_id else {}))
        self._inbox.put(req)
        self._wake.set()
        return req

    def stream(self, req: Request, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Yield `req`'s events until its last one (finish_reason set)."""
        while True:
            event = req.events.get(timeout=timeout)
            yield event
            if event.finish_reason is not None:
                return

    async def astream(self, req: Request) -> AsyncIterator[TokenEvent]:
        """`stream` for asyncio: the events of `req`, awaited on the event loop (the scheduler thread hands
        each one over with call_soon_threadsafe; no thread waits per request)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        for event in req.listen(lambda e: loop.call_soon_threadsafe(events.put_nowait, e)):
            events.put_nowait(event)
        while True:
            event = await events.get()
            yield event
            if event.finish_reason is not None:
                return

    def cancel(self, req: Request) -> None:
        """Stop `req` at the next step boundary and free its slot."""
        req.cancel()
        self._wake.set()

    # ------------------------------------------------------------------ state

    def health(self) -> tuple[bool, str]:
        """(ready, reason): ready once every rank has loaded, until one fails or the engine closes."""
        if self.failure is not None:
            return False, f"a rank failed: {self.failure.summary}"
        if self._closing.is_set() or getattr(self, "_closing_admission", False):
            return False, "the engine is shutting down"
        if not self.started:
            return False, "the ranks are loading the model"
        return True, "ok"

    def cached_tokens(self) -> int:
        """Tokens in the KV cache, or on their way in a step under way (prompt tokens sent to the ranks plus tokens
        generated, over running requests)."""
        return sum(r.prefilled + len(r.output_ids) for r in list(self.scheduler.running))

    def stats(self) -> EngineStats:
        """Requests running and waiting, slots, steps run, finished requests by reason, health."""
        ok, reason = self.health()
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting) + self._inbox.qsize(), s.slots, s.step_id,
                           dict(s.finished_by_reason), ok, reason)

    # ------------------------------------------------------------------ the scheduler thread

    def _loop(self) -> None:
        under_way = None  # a step sent whose result is not applied yet (pipelined steps)
        try:
            while not self._closing.is_set():
                self._take_new()
                if under_way is not None and self.scheduler.prompt_work():
                    self._apply(under_way)  # plan prompts on the latest results: admit into every slot it frees
                    under_way = None
                    self._take_new()
                step = self.scheduler.next_step()
                if step.empty:
                    if under_way is not None:  # its tokens may make work for the next step
                        self._apply(under_way)
                        under_way = None
                    else:
                        self._wait_for_work()
                    continue
                if self._gather.begin():  # a poll is waiting: the ranks send their counters after this step
                    step = dataclasses.replace(step, report_stats=True)
                self.group.send(step)
                if under_way is not None:
                    self._apply(under_way)
                under_way = step
                if not self.pipelined:
                    self._apply(step)
                    under_way = None
            if under_way is not None:
                self._apply(under_way)
            self._take_new()
            self.scheduler.cancel_all()
        except RankFailure as e:
            self.failure = e
            log.error("%s", e.summary)
            self.scheduler.fail_all(e.summary)
        except BaseException as e:  # noqa: BLE001 - a driver bug: fail every request, keep the message
            self.failure = RankFailure(f"the engine failed: {type(e).__name__}: {e}")
            log.exception("the engine's scheduler failed")
            self.scheduler.fail_all(str(self.failure))
            self.group.stop(force=True)

    def _apply(self, step) -> None:
        """Wait for `step`'s result and hand it to the scheduler (streams tokens, retires finished requests)."""
        self.scheduler.apply(step, self._receive_step(step.repeat), self.tokenizer)

    def _drained(self) -> bool:
        return self._inbox.empty() and self.scheduler.idle()

    def rank_stats(self, timeout: float = 30.0) -> list[dict]:
        """Every rank's counters (memory, collectives, streaming): sent by the ranks after the next step, or
        at once when the engine is idle (queue.Empty after `timeout` seconds)."""
        box: queue.Queue = queue.Queue()
        self._gather.asks.put(box)
        self._wake.set()
        return box.get(timeout=timeout)

    def _receive_step(self, runs: int = 1):
        """The step's result; the ranks' counters that arrive meanwhile go to the gathering under way. A step of
        `runs` decode runs may take that many times the timeout (`timeout_s` bounds a token, not a message)."""
        while True:
            kind, rank, payload = self.group.receive(self.group.timeout_s * runs)
            if kind == "stats":
                self._gather.take(rank, payload)
            elif kind == "step":
                return payload

    def _finish_stats(self) -> None:
        """Idle: complete the gathering under way, or start one for pending asks (a "stats" message)."""
        if self._gather.begin():
            self.group.send("stats")
        while self._gather.under_way:
            kind, rank, payload = self.group.receive(self.group.timeout_s)
            if kind == "stats":
                self._gather.take(rank, payload)

    def _take_new(self) -> None:
        while True:
            try:
                self.scheduler.add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _wait_for_work(self) -> None:
        """Idle: wait for a request or close(), checking the ranks' heartbeats meanwhile."""
        while not self._closing.is_set() and self._inbox.empty() and not self._any_cancelled():
            self._finish_stats()
            if self._gather.pending():
                continue
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            self.group.check()

    def _any_cancelled(self) -> bool:
        return any(r.cancelled.is_set() for r in list(self.scheduler.waiting) + list(self.scheduler.running))


class StatsGather:
    """Every rank's counters for the rank_stats() calls waiting: a gathering starts when none is under way,
    answers every call pending at its start, and ends when each rank has sent its counters."""

    def __init__(self, world: int):
        self.world = world
        self.asks: queue.Queue[queue.Queue] = queue.Queue()
        self._boxes: list[queue.Queue] = []
        self._got: dict[int, dict] | None = None

    @property
    def under_way(self) -> bool:
        """Counters were asked of the ranks and some have not arrived."""
        return self._got is not None

    def pending(self) -> bool:
        """Calls are waiting for a gathering not yet started."""
        return not self.asks.empty()

    def begin(self) -> bool:
        """Start a gathering for the pending calls; False when none is pending or one is under way."""
        if self._got is not None or self.asks.empty():
            return False
        while not self.asks.empty():
            self._boxes.append(self.asks.get_nowait())
        self._got = {}
        return True

    def take(self, rank: int, counters: dict) -> None:
        """Rank `rank`'s counters; the last of them answers the calls."""
        if self._got is None:
            return
        self._got[rank] = counters
        if len(self._got) == self.world:
            answer = [self._got[r] for r in range(self.world)]
            for box in self._boxes:
                box.put(answer)
            self._boxes, self._got = [], None
