"""Run a function on N local gloo ranks and collect each rank's result or traceback.

Used by the distributed tests and the benchmarks: every wait has a timeout, a failing rank's
traceback is reported together with which rank it was, and no process outlives the call.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import forkserver
from typing import Any, Callable, Iterator

from shardlm.settings import huge_page_children


class DeviceError(RuntimeError):
    """A device was asked for that this machine or this torch build cannot provide."""


class RanksFailed(RuntimeError):
    """One or more ranks raised, died or timed out; the message holds every rank's traceback."""


def store_listener() -> socket.socket:
    """A socket listening on a free 127.0.0.1 port, for rank 0's rendezvous store (pass it to `join_group`).

    Bound and listening before any rank starts, so a rank that connects before rank 0 has built
    its store waits in the listen queue instead of retrying with back-off (that cost 0.3-0.6 s of
    start-up in some runs, measured), and no other process can take the port in between.
    """
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(128)
    except OSError:
        s.close()
        raise
    return s


def pick_backend(device: str, world: int, gpus: int) -> str:
    """The collective backend for `world` ranks on `device` ("cpu" or "cuda") with `gpus` visible GPUs.

    NCCL when every rank has a GPU of its own. NCCL refuses two ranks on one GPU ("duplicate GPU"),
    so ranks that share GPUs (more ranks than GPUs) use gloo, staging CUDA tensors through host
    memory (see ParallelContext); CPU ranks always use gloo.
    """
    return "nccl" if device == "cuda" and 0 < world <= gpus else "gloo"


def rank_device(device: str, rank: int, gpus: int) -> str:
    """The torch device of global `rank`: "cpu", or "cuda:i" with ranks dealt round-robin over `gpus` GPUs."""
    if device != "cuda":
        return "cpu"
    if gpus < 1:
        raise DeviceError("--device cuda was asked for, but torch sees no CUDA device (torch.cuda.is_available() "
                           "is False: a CPU build of torch, or no driver); use --device cpu, or run where a GPU and a "
                           "CUDA build of torch are installed")
    return f"cuda:{rank % gpus}"


def join_group(rank: int, world: int, port: int, listener: socket.socket | None, timeout_s: float,
               backend: str = "gloo") -> None:
    """Join the world of `world` ranks whose store listens on 127.0.0.1:`port`, on `backend`
    ("gloo", or "nccl" after each rank has called torch.cuda.set_device on its own GPU).

    Rank 0 passes the `store_listener` socket (it serves the store on it); the others pass None.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", port, world, True, timeout, master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def threads_per_rank(world: int) -> int:
    """Torch threads for each of `world` ranks on this machine: its cores shared among them."""
    return max(1, (os.cpu_count() or 1) // world)


def _entry(fn: Callable, rank: int, world: int, port: int, listener, threads: int, args: tuple, results,
           backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank_device("cuda", rank, torch.cuda.device_count()))
        join_group(rank, world, port, listener, 120, backend)
        # every rank's mesh is whole before any rank can finish and close its sockets: rank 0 once returned from
        # init, ran a quick fn and exited while rank 1's gloo connectFullMesh was still running ("Connection closed
        # by peer", seen once in a suite run)
        dist.barrier()
        out = fn(rank, world, *args)
        # plain pickle copies tensor data; the queue's own pickler would pass shared-memory handles
        # that vanish when this process exits
        results.put((rank, "ok", pickle.dumps(out)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it with the rank number
        results.put((rank, "error", traceback.format_exc()))
    results.close()
    results.join_thread()


FORK_PRELOAD = ["torch", "torch.distributed", "shardlm.runtime.worker"]
"""What the fork server imports before it forks its first rank (a rank's own imports: torch is 1.5 of their 1.7 s)."""
_SERVER_HUGE_PAGES: list[bool] = []
"""Whether this process's fork server started with glibc's malloc asking for huge pages (set at its first start)."""


def start_fork_server(huge_pages: bool = True) -> bool:
    """Start the fork server CPU ranks fork from, once a process (again if it died); returns whether its ranks run
    glibc's malloc with huge pages (settings.huge_page_children), fixed by the first call.

    The server imports FORK_PRELOAD and then waits, so a command that will start ranks calls this first (the
    `shardlm` entry point does, for generate and serve): the import runs while the driver parses, plans and loads
    the tokenizer, and each rank then starts in about 0.1 s. The call itself does not wait for the import."""
    if not _SERVER_HUGE_PAGES:
        mp.get_context("forkserver").set_forkserver_preload(FORK_PRELOAD)
        _SERVER_HUGE_PAGES.append(huge_pages)
        atexit.register(stop_fork_server)
    with huge_page_children(_SERVER_HUGE_PAGES[0]), _no_interrupts():  # what the server (re)starts with
        forkserver.ensure_running()
    return _SERVER_HUGE_PAGES[0]


@contextlib.contextmanager
def _no_interrupts() -> Iterator[None]:
    """While open (on the main thread), SIGINT is ignored, so a process started inside ignores it from its first
    instruction (an ignored signal stays ignored across exec, and Python then installs no handler of its own): a
    Ctrl-C while the fork server imports torch printed its KeyboardInterrupt traceback. The driver handles Ctrl-C
    and stops every rank; the ranks ignore it too (runtime/worker.py)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def stop_fork_server() -> None:
    """End this process's fork server now (at exit): left alone, a server still importing torch would hold this
    process's stdout and stderr open until the import ends (a command that failed on bad input in 0.6-0.8 s kept a
    caller that read its output waiting 1.9-2.0 s), and a server ends its ranks with it (PR_SET_PDEATHSIG), which
    the engine has stopped by then. Uses multiprocessing's record of the server's pid; where that is missing,
    nothing is done (the server still exits once it sees this process gone)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if not pid:
        return
    try:
        os.kill(pid, signal.SIGKILL)  # not reaped here: ensure_running reaps it should this process start another
    except ProcessLookupError:
        pass


def rank_context(cuda: bool = False, huge_pages: bool | None = None) -> mp.context.BaseContext:
    """The multiprocessing context ranks start from (`run_on_ranks`, engine/ranks.py).

    CPU ranks fork from the fork server (`start_fork_server`), which has imported torch once: a spawned rank
    imports torch afresh (1.7 s for two ranks, 3.5 s for four, of a 2-core VM's time, against 0.07 and 0.11 s
    forked; measured 2026-12-07). The server only imports, so no OpenMP pool exists to be forked. A forked rank
    sees the environment the server started with (at the first call), not later changes to it: a rank's settings
    travel in its launch message instead. Spawned, a fresh interpreter each: `cuda` ranks, so that CUDA is
    initialised in no process they fork from, and ranks whose `huge_pages` (None: either) differs from the
    server's, since glibc reads its tunables only when a program starts.
    """
    if cuda:
        return mp.get_context("spawn")
    server = start_fork_server(True if huge_pages is None else huge_pages)
    if huge_pages is not None and huge_pages != server:
        return mp.get_context("spawn")
    return mp.get_context("forkserver")


def run_on_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 300.0,
                 threads: int | None = None, backend: str = "gloo") -> list[Any]:
    """Call `fn(rank, world, *args)` in `world` processes (`rank_context`) joined in a `backend` group
    (gloo, or nccl with rank r on GPU r).

    `fn` must be importable (module level). Returns the results in rank order; raises RanksFailed
    with every failing rank's traceback, or naming the ranks that did not answer in `timeout_s`.
    """
    ctx = rank_context(cuda=backend == "nccl")  # NCCL ranks run on GPUs
    results = ctx.Queue()
    listener = store_listener()
    port = listener.getsockname()[1]
    threads = threads or threads_per_rank(world)
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, listener if r == 0 else None, threads, args, results,
                                                        backend),
                         daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
    finally:
        listener.close()  # rank 0 holds its own copy
    got: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got | errors.keys()]
                if dead and not errors:
                    time.sleep(1.0)  # let a failing rank's traceback arrive before the others' timeouts
                    if results.empty():
                        errors.update({r: f"died with exit code {procs[r].exitcode}" for r in dead})
                continue
            if status == "ok":
                got[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if errors:
                deadline = min(deadline, time.monotonic() + 5)  # peers of a failed rank will hang or fail
    finally:
        died = _stop(procs, gently=not errors)
    # a rank that exited without a word, found after a peer's failure, is named with its exit code
    errors.update({r: f"died with exit code {code}" for r, code in died.items() if r not in got and r not in errors})
    missing = [r for r in range(world) if r not in got and r not in errors]
    if errors or missing:
        parts = [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
        if missing:
            waited = f"within {timeout_s:.0f} s" if not errors else "before they were stopped after the failures above"
            parts.append(f"ranks {missing} did not answer {waited}")
        raise RanksFailed("\n".join(parts))
    return [got[r] for r in range(world)]


def _stop(procs: list, gently: bool) -> dict[int, int]:
    """Join `procs` (2 s each when `gently`, else 0.1 s), killing any still alive; the exit codes of those that
    had ended on their own with a non-zero code, by rank."""
    died = {}
    for r, p in enumerate(procs):
        p.join(timeout=2 if gently else 0.1)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
        elif p.exitcode not in (None, 0):
            died[r] = p.exitcode
    return died
