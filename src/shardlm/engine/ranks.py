"""The rank processes of one Plan on this machine: spawned once, fed through their own inboxes, watched.

Each rank has an inbox (a pipe, `Inbox`) the driver writes to, so a rank with nothing to do waits on its own pipe
(no collective, no timeout: an engine may sit idle for hours) and all ranks share one outbox. A
rank is watched three ways, and the first that fires names it and stops every rank:
- it reports an error (its traceback comes with it; a peer that only lost its link to a dead rank
  defers to the dead rank);
- its process exits or is killed (found within a poll, 0.2 s);
- its heartbeat (runtime/heartbeat.py) stops moving for HANG_S: stopped with SIGSTOP, or wedged.
The driver dies => the ranks die (PR_SET_PDEATHSIG: a spawned rank's parent is the driver; a forked one's is the
fork server, which exits when the driver does); a rank never outlives its engine.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
import time
from dataclasses import dataclass, field

from shardlm.models.source import ModelSource
from shardlm.parallel.launch import rank_context, store_listener, threads_per_rank
from shardlm.plan.plan import Plan
from shardlm.runtime.protocol import RankLaunch
from shardlm.settings import Settings, huge_page_children

log = logging.getLogger(__name__)

SHM_SLOT_BYTES = 8 * 2**20
"""Largest collective sent through shared memory (decode steps and modest prefills); larger go via gloo."""
HANG_S = 4.0
"""A loaded rank whose heartbeat stops for this long is hung (named within HANG_S plus a poll)."""
LOAD_HANG_S = 60.0
"""The same while a rank is still loading (a long C-level import can hold up its heartbeat thread)."""
POLL_S = 0.2
LINK_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
"""What a rank reports when it only lost its link to a peer that died."""


class Inbox:
    """A rank's inbox: a pipe the driver writes each message into from the thread that sends it.

    A multiprocessing.Queue hands each message to a feeder thread that pickles and writes it; in a server that
    thread waits for the GIL while the event loop streams the step's tokens, and a rank waited 1.2 ms (median,
    2.2 ms p90) for each step the driver had already sent, ~7 % of a 16-row decode step (instrumented `bench/serve.py`
    run at concurrency 16). Here the sender's own thread, which holds the GIL already, writes it. A message larger
    than the pipe's buffer makes the sender wait until the rank reads it, after the step it is running; the
    outbox stays a Queue, so a rank never waits to report."""

    def __init__(self, ctx):
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._lock: threading.Lock | None = threading.Lock()  # the scheduler thread and stop() may both send

    def __getstate__(self) -> dict:  # a rank gets the reading end only
        return {"_reader": self._reader, "_writer": None, "_lock": None}

    def put(self, message) -> None:
        """Send `message` to the rank (driver side)."""
        with self._lock:
            self._writer.send(message)

    def get(self, timeout: float | None = None):
        """The next message (rank side); queue.Empty when none came within `timeout` seconds (None: wait)."""
        if timeout is not None and not self._reader.poll(timeout):
            raise queue.Empty
        return self._reader.recv()


class RankFailure(RuntimeError):
    """A rank process failed, died or hung; the message names the rank and carries its traceback.

    `user_error` is True when the rank refused bad input (a checkpoint that does not match its
    config, say) rather than crashing; `summary` is then a one-line explanation.
    """

    def __init__(self, message: str, summary: str = "", user_error: bool = False, rank: int | None = None):
        super().__init__(message)
        self.summary = summary or message
        self.user_error = user_error
        self.rank = rank


def _rank_main(launch: RankLaunch, inbox, outbox, listener, stamps) -> None:
    """The rank processes' entry point. The heartbeat starts first; torch and the model code are imported
    after it, in the rank, so the driver never imports them."""
    from shardlm.runtime.heartbeat import start_heartbeat

    start_heartbeat(stamps, launch.spec.rank)
    from shardlm.runtime.worker import rank_main

    rank_main(launch, inbox, outbox, listener)


@dataclass
class RankGroup:
    """The ranks of `plan` as local processes (see the module docstring)."""

    plan: Plan
    source: ModelSource
    settings: Settings = field(default_factory=Settings.from_env)
    threads: int | None = None
    """Torch threads per rank; default: this machine's cores divided among the ranks."""
    shm: bool = True
    """Use the shared-memory transport for collectives between local ranks."""
    timeout_s: float = 300.0
    """Longest wait for a peer inside a collective, and for one step's result. Loading has no deadline: a
    rank that dies or stops its heartbeat while loading is reported at once, a slow disk is not a fault."""
    ready: list[dict] = field(default_factory=list)
    load_s: float = 0.0

    @property
    def world(self) -> int:
        """Rank processes."""
        return self.plan.world

    def start(self) -> "RankGroup":
        """Spawn the ranks and wait until every one has loaded its part of the model."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the rank processes (they begin loading at once). CPU ranks fork from the fork server
        (parallel/launch.py's rank_context); the others are spawned, and should be started from a thread that
        outlives them (the main thread): a spawned rank is killed when the thread that started it ends
        (PR_SET_PDEATHSIG)."""
        self._t0 = time.perf_counter()
        ctx = self._context()
        world = self.world
        self.inboxes = [Inbox(ctx) for _ in range(world)]
        self.outbox = ctx.Queue()
        self.stamps = ctx.RawArray("d", world)
        threads = self.threads or threads_per_rank(world)
        listener = store_listener()  # rank 0 serves the rendezvous store on it
        port = listener.getsockname()[1]
        shm_bytes = SHM_SLOT_BYTES if self.shm and self.plan.layout.tp > 1 else 0
        self.procs = []
        try:
            for rank in range(world):
                launch = RankLaunch(self.plan.rank_spec(rank), self.source, port, threads, shm_bytes, self.timeout_s,
                                    self.settings)
                p = ctx.Process(target=_rank_main, daemon=True, name=f"shardlm-rank{rank}",
                                args=(launch, self.inboxes[rank], self.outbox, listener if rank == 0 else None,
                                      self.stamps))
                with huge_page_children(self._huge_pages(rank) and ctx.get_start_method() == "spawn"):
                    p.start()
                self.procs.append(p)
        finally:
            listener.close()  # rank 0 holds its own copy

    def _huge_pages(self, rank: int) -> bool:
        """Whether rank `rank` runs glibc's malloc with huge pages: where its weights stay put (a rank that streams
        layers keeps its 1 MiB mmap threshold, runtime/worker.py's set_malloc)."""
        return self.settings.huge_pages and self.plan.rank_spec(rank).offload.tier == "none"

    def _context(self):
        """Where the ranks start from: CPU ranks that agree on huge pages fork from the fork server; GPU ranks, and
        ranks that differ from it or each other, are spawned."""
        wants = {self._huge_pages(rank) for rank in range(self.world)}
        if len(wants) > 1:  # one context serves the group: spawned, each rank with its own tunables
            return mp.get_context("spawn")
        return rank_context(cuda=self.plan.device != "cpu", huge_pages=wants.pop())

    def wait_ready(self) -> "RankGroup":
        """Wait until every spawned rank has loaded; RankFailure naming a rank that failed, died or hung."""
        got = {}
        while len(got) < self.world:
            kind, rank, payload = self.receive(None)
            if kind == "ready":
                got[rank] = payload
        self.ready = [got[r] for r in range(self.world)]
        self.load_s = time.perf_counter() - self._t0
        log.info("%d rank(s) ready in %.1f s", self.world, self.load_s)
        return self

    def send(self, message) -> None:
        """Put `message` in every rank's inbox (they all run the same steps)."""
        for box in self.inboxes:
            box.put(message)

    def receive(self, timeout: float | None = None) -> tuple:
        """The next (kind, rank, payload) from any rank; RankFailure when a rank failed, died or hung, or
        none reported within `timeout` seconds (None: wait as long as every rank is alive)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            try:
                msg = self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                self.check()
                continue
            if msg[0] == "error":
                raise self._root_cause(msg)
            return msg
        self.stop(force=True)
        raise RankFailure(f"no rank reported for {timeout:.3g} s; stopped every rank (raise timeout_s if the model "
                          "is that slow)")

    def check(self) -> None:
        """Raise RankFailure (after stopping every rank) when a rank has exited or stopped its heartbeat."""
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None:
                self._died(rank, p)
        now = time.monotonic()
        for rank in range(self.world):
            stamp, limit = self.stamps[rank], HANG_S if self.ready else LOAD_HANG_S
            if stamp and now - stamp > limit:
                pid = self.procs[rank].pid
                self.stop(force=True)
                raise RankFailure(f"rank {rank} (pid {pid}) stopped responding: no heartbeat for {now - stamp:.1f} s "
                                  f"(stopped with SIGSTOP, or wedged in a system call); stopped every rank",
                                  rank=rank)

    def _died(self, rank: int, p) -> None:
        time.sleep(0.5)  # give a failing rank's own error message time to arrive first
        try:
            msg = self.outbox.get_nowait()
            if msg[0] == "error":
                raise self._root_cause(msg)
        except queue.Empty:
            pass
        self.stop(force=True)
        how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
        early = ("" if self.ready or p.exitcode < 0 else
                 " before it could report; its own error is printed above (a script that starts an engine needs "
                 "the `if __name__ == \"__main__\":` guard, as ranks are spawned)")
        raise RankFailure(f"rank {rank} (pid {p.pid}) died with {how}{early}; stopped every rank", rank=rank)

    def _root_cause(self, msg: tuple) -> RankFailure:
        """Stop every rank and name the first failure: a rank that died, when the reporting rank only lost its
        link to it, else the rank that reported `msg`."""
        _, rank, summary, tb, user_error = msg
        dead = []
        if any(e in summary for e in LINK_ERRORS):  # only a link broke: look for the rank that died
            deadline = time.monotonic() + 3.0
            while not dead and time.monotonic() < deadline:
                dead = [(r, p) for r, p in enumerate(self.procs) if p.exitcode is not None and r != rank]
                time.sleep(0.05)
        self.stop(force=True)
        if dead:
            r, p = dead[0]
            how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
            return RankFailure(f"rank {r} (pid {p.pid}) died with {how}; stopped every rank (rank {rank} then lost "
                               f"its link to it: {summary})", rank=r)
        return RankFailure(f"rank {rank} failed: {summary}\n--- rank {rank} traceback ---\n{tb}",
                           summary=f"rank {rank}: {summary}", user_error=user_error, rank=rank)

    def stop(self, force: bool = False) -> None:
        """Stop every rank: politely (a stop message) unless `force`, then terminate, then kill."""
        procs = getattr(self, "procs", [])
        if not force and all(p.is_alive() for p in procs):
            self.send(None)
            for p in procs:
                p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join(timeout=3)
