"""LocalEngine: run a Plan as one process per rank on this machine, feed them requests, collect tokens.

The engine takes a Plan and a model source; rank r receives `plan.rank_spec(r)` in its launch
message and builds its part from that alone. The driver owns the rank processes: it stops all of
them when one fails, when the user presses Ctrl-C, or when it exits; ranks also die with the driver
(PR_SET_PDEATHSIG), so none is orphaned.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import time
from dataclasses import dataclass, field
from typing import Callable

from shardlm.models.source import ModelSource
from shardlm.parallel.launch import store_listener, threads_per_rank
from shardlm.parallel.stages import auto_micro_batches
from shardlm.plan.plan import Plan
from shardlm.runtime.protocol import RankLaunch, Request, SamplingParams
from shardlm.settings import Settings

log = logging.getLogger(__name__)

SHM_SLOT_BYTES = 8 * 2**20
"""Largest collective sent through shared memory (decode steps and modest prefills); larger go via gloo."""


class RankFailure(RuntimeError):
    """A rank process failed or died; the message names the rank and carries its traceback.

    `user_error` is True when the rank refused bad input (a checkpoint that does not match its
    config, say) rather than crashing; `summary` is then a one-line explanation.
    """

    def __init__(self, message: str, summary: str = "", user_error: bool = False):
        super().__init__(message)
        self.summary = summary or message
        self.user_error = user_error


def _rank_main(launch: RankLaunch, requests, results, listener=None) -> None:
    """The rank processes' entry point: torch and the model code are imported here, in the rank,
    so that the driver never imports them (see runtime/protocol.py)."""
    from shardlm.runtime.worker import rank_main

    rank_main(launch, requests, results, listener)


def _failure(msg: tuple) -> RankFailure:
    _, rank, summary, tb, user_error = msg
    return RankFailure(f"rank {rank} failed: {summary}\n--- rank {rank} traceback ---\n{tb}",
                       summary=f"rank {rank}: {summary}", user_error=user_error)


@dataclass
class GenerateResult:
    """What one generate call produced, plus per-rank stats."""

    token_ids: list[list[int]]
    ranks: list[dict]
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    decode_tokens: int


@dataclass
class LocalEngine:
    """The Plan's ranks as local processes over gloo (and shared memory for each stage's collectives),
    or over NCCL when they run on GPUs of their own."""

    plan: Plan
    """What runs: layout, numerics, offload, KV budget (each rank gets plan.rank_spec(rank))."""
    source: ModelSource
    """The checkpoint and the model's shape."""
    settings: Settings = field(default_factory=Settings.from_env)
    """Kernels, cache folder and log level, sent to every rank."""
    threads: int | None = None
    """Torch threads per rank; default: this machine's cores divided among the ranks."""
    shm: bool = True
    """Use the shared-memory transport for collectives between local ranks."""
    timeout_s: float = 300.0
    """Longest wait for any rank; a silent rank past it is reported as hung."""
    load_s: float = 0.0
    ready: list[dict] = field(default_factory=list)
    last_comms: list = field(default_factory=list)
    """Each rank's cumulative comms counters after the last generate (for deltas)."""

    @property
    def world(self) -> int:
        """Rank processes."""
        return self.plan.world

    def start(self) -> "LocalEngine":
        """Spawn the ranks and wait until every one has loaded its part of the model."""
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")
        self._requests, self._results = ctx.Queue(), ctx.Queue()
        world = self.world
        threads = self.threads or threads_per_rank(world)
        listener = store_listener()  # rank 0 serves the rendezvous store on it
        port = listener.getsockname()[1]
        shm_bytes = SHM_SLOT_BYTES if self.shm and self.plan.layout.tp > 1 else 0
        self._procs = []
        try:
            for rank in range(world):
                launch = RankLaunch(self.plan.rank_spec(rank), self.source, port, threads, shm_bytes, self.timeout_s,
                                    self.settings)
                p = ctx.Process(target=_rank_main, args=(launch, self._requests, self._results,
                                                         listener if rank == 0 else None),
                                daemon=True, name=f"shardlm-rank{rank}")
                p.start()
                self._procs.append(p)
        finally:
            listener.close()  # rank 0 holds its own copy
        ready = {}
        while len(ready) < world:
            kind, rank, payload = self._next()
            if kind == "ready":
                ready[rank] = payload
        self.ready = [ready[r] for r in range(world)]
        self.load_s = time.perf_counter() - t0
        log.info("%d rank(s) ready in %.1f s", world, self.load_s)
        return self

    def _next(self) -> tuple:
        """Next message from any rank; raises RankFailure if a rank failed, died or went silent."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                msg = self._results.get(timeout=0.2)
            except queue.Empty:
                self._check_alive()
                continue
            if msg[0] == "error":
                raise self._root_cause(msg)
            return msg
        self.stop(force=True)
        raise RankFailure(f"no rank reported for {self.timeout_s:.0f} s; stopped all ranks (raise timeout_s if "
                          "the model is that slow)")

    def _root_cause(self, msg: tuple) -> RankFailure:
        """Stop every rank and name the first failure: a rank killed by a signal, when its peers only
        failed because their link to it broke, else the rank that reported `msg`."""
        deadline = time.monotonic() + 1.0
        killed = []
        while not killed and time.monotonic() < deadline:
            killed = [(r, p) for r, p in enumerate(self._procs) if p.exitcode is not None and p.exitcode < 0]
            time.sleep(0.05)
        self.stop(force=True)
        if killed:
            rank, p = killed[0]
            return RankFailure(f"rank {rank} (pid {p.pid}) died with signal {-p.exitcode}; stopped every rank "
                               f"(rank {msg[1]} then lost its link to it: {msg[2]})")
        return _failure(msg)

    def _check_alive(self) -> None:
        for rank, p in enumerate(self._procs):
            if p.exitcode is not None:
                time.sleep(0.5)  # give a failing rank's own error message time to arrive first
                try:
                    msg = self._results.get_nowait()
                    if msg[0] == "error":
                        self.stop(force=True)
                        raise _failure(msg)
                except queue.Empty:
                    pass
                self.stop(force=True)
                how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
                early = ("" if self.ready or p.exitcode < 0 else
                         " before it could report; its own error is printed above (a script that starts a "
                         "LocalEngine needs the `if __name__ == \"__main__\":` guard, as ranks are spawned)")
                raise RankFailure(f"rank {rank} (pid {p.pid}) died with {how}{early}; stopped every rank")

    def micro_batches(self, batch: int) -> int:
        """Micro-batches for a batch of `batch` rows: the plan's, else one per stage capped by the batch."""
        pp = self.plan.layout.pp
        return 1 if pp == 1 else min(batch, self.plan.micro_batches or auto_micro_batches(batch, pp))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams,
                 pad_id: int = 0, on_token: Callable[[list[int]], None] | None = None,
                 ignore_eos: bool = False) -> GenerateResult:
        """Run one batch to completion; `on_token` gets each step's tokens (-1 for rows without one).

        With pipeline stages, `micro_batches(len(prompts))` groups of rows are in flight at once and
        `on_token` is called once per micro-batch step.
        """
        self._requests.put(Request(prompts, max_new_tokens, sampling, pad_id, ignore_eos,
                                   self.micro_batches(len(prompts))))
        reports: dict[int, dict] = {}
        while len(reports) < self.world:
            kind, rank, payload = self._next()
            if kind == "token" and on_token is not None:
                on_token(payload)
            elif kind == "done":
                reports[rank] = payload
        ranks = [reports[r] for r in range(self.world)]
        for r in ranks[1:]:
            if r["tokens"] is not None and r["tokens"] != ranks[0]["tokens"]:
                raise RankFailure("ranks produced different tokens (their logits disagree); this is a bug, please report it")
        self.last_comms = [r["comms"] for r in ranks]
        r0 = ranks[0]
        return GenerateResult(r0["tokens"], ranks, r0["prefill_s"], r0["decode_s"], r0["prompt_tokens"], r0["decode_tokens"])

    def stop(self, force: bool = False) -> None:
        """Stop every rank: politely (a stop request) unless `force`, then terminate, then kill."""
        procs = getattr(self, "_procs", [])
        if not force and all(p.is_alive() for p in procs):
            self._requests.put(None)
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

    def __enter__(self) -> "LocalEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(force=exc[0] is not None)
