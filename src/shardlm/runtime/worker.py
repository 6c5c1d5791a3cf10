"""The rank process: join the group, build this rank's model, run the driver's steps until told to stop.

Every rank has its own inbox: the driver puts each engine step (runtime/work.py) in all of them, and
every rank runs it (collectives inside the model keep the ranks of a stage in lock-step; pipeline
stages pass hidden states on). The rank that holds the LM head's full logits first (tp rank 0 of the
last stage) reports what the step sampled. A rank with nothing to do waits on its inbox, with no
deadline: the driver watches its heartbeat instead (engine/ranks.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from shardlm import logs
from shardlm.checkpoint.headers import CheckpointError
from shardlm.models.args import ModelConfigError
from shardlm.parallel.context import ParallelContext, PipePeers
from shardlm.parallel.launch import DeviceError, join_group, pick_backend, rank_device
from shardlm.parallel.pipeline import pipeline_context
from shardlm.quant_spec import QuantizationError
from shardlm.runtime.ahead import serve_steps
from shardlm.runtime.build import build_rank_model
from shardlm.runtime.offload import OffloadError
from shardlm.runtime.protocol import RankLaunch
from shardlm.runtime.rank_model import RankModel
from shardlm.runtime.serve_step import SlotRunner

log = logging.getLogger(__name__)
USER_ERRORS = (CheckpointError, ModelConfigError, QuantizationError, OffloadError, DeviceError)
"""Failures that are bad input (reported in one line), not crashes."""


def _die_with_parent(rank: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (the driver, or the fork server, which exits with the
    driver), so no rank is ever orphaned; and name it shardlm-rank<rank> (what ps, top and psutil show)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        libc.prctl(15, f"shardlm-rank{rank}".encode()[:15])  # 15 = PR_SET_NAME (15 bytes at most)
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before the request: nothing would signal this process
        os._exit(1)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's mallopt parameters (malloc.h)."""

HEAP_MMAP_THRESHOLD = 32 * 2**20
"""Below this a tensor comes from the heap: glibc's own ceiling for its moving threshold (32 MiB on 64-bit)."""


def set_malloc(offloads: bool) -> bool:
    """Fix glibc's malloc thresholds for this rank process; False where libc is not glibc (nothing set).

    glibc maps each block over its mmap threshold afresh (and unmaps it when freed), and hands the top of the
    heap back to the system once more than its trim threshold is free there. Both start at 128 KiB and move up
    only when a mapped block is freed, so they depended on what loading happened to free: the same rank's
    512-token prefill took 23 000-75 000 page faults and ran at 1200-1470 tok/s in some runs and ~0 faults and
    1560-1640 tok/s in others (bundled model, int4 and float32, in-process). A rank that keeps its layers fixes
    them at glibc's own ceiling (32 MiB, trim at 64 MiB): activations come from the heap and stay there, so a
    prefill reuses pages the last one touched (peak RSS unchanged, measured; a server keeps at most 64 MiB of
    free heap above that). A rank that `offloads` (layers or its vocabulary, to disk or host memory: it loads and
    drops large tensors) instead fixes the mmap threshold at 1 MiB, so they go back to the system at once: with
    glibc's moving threshold its peak RSS for the same 250 MiB budget varied from +264 to +443 MiB (the heap kept
    what dropped layers freed).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        if offloads:
            return libc.mallopt(M_MMAP_THRESHOLD, 2**20) == 1
        return libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD) == 1 \
            and libc.mallopt(M_TRIM_THRESHOLD, 2 * HEAP_MMAP_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes.

    Read from VmHWM, which starts afresh at exec. `getrusage().ru_maxrss` does not: Linux carries it
    across fork and exec, so a spawned rank would report its parent's peak if that was larger.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_main(launch: RankLaunch, inbox, outbox, listener=None) -> None:
    """Entry point of a rank process; reports errors with their traceback instead of raising."""
    _die_with_parent(launch.spec.rank)
    malloc_set = set_malloc(launch.spec.offload.tier != "none")  # before the rank allocates anything large
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver handles Ctrl-C and stops every rank
    spec = launch.spec
    logs.setup(launch.settings.log_level, logs.rank_label(spec.rank, spec.stage, spec.tp_rank))
    if not malloc_set:
        log.debug("malloc thresholds left as they were (not glibc, or mallopt refused them)")
    code = 0
    try:
        _serve(launch, inbox, outbox, listener)
    except BaseException as e:  # noqa: BLE001 - report every failure to the driver, then exit non-zero
        outbox.put(("error", spec.rank, f"{type(e).__name__}: {e}", traceback.format_exc(),
                    isinstance(e, USER_ERRORS)))
        code = 1
    outbox.close()
    outbox.join_thread()  # flush the last messages before exiting
    # Skip the interpreter's teardown: with torch loaded it took 0.5 s of every command's wall time
    # (measured), and there is nothing left to clean up (scratch files, shared memory and the
    # process group were closed by _serve).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _setup(launch: RankLaunch, listener) -> tuple[ParallelContext, str]:
    """Join the group on this rank's device; returns the context and the device ("cpu" or "cuda:i")."""
    spec = launch.spec
    torch.set_num_threads(launch.threads)
    gpus = torch.cuda.device_count() if spec.device == "cuda" else 0
    device = rank_device(spec.device, spec.rank, gpus)
    backend = pick_backend(spec.device, spec.world, gpus)
    if device != "cpu":
        torch.cuda.set_device(device)
    join_group(spec.rank, spec.world, launch.port, listener, launch.timeout_s, backend)
    pipe = PipePeers(spec.stage, spec.pp, spec.prev, spec.next, spec.first, spec.last) if spec.pp > 1 else None
    # the shared-memory transport serves host tensors: with gloo, CUDA ranks stage through it too
    ctx = pipeline_context(spec.rank, spec.tp_groups, pipe, launch.shm_bytes if backend == "gloo" else 0,
                           launch.timeout_s, nccl=backend == "nccl")
    log.info("joined %d ranks on %s (%s)", spec.world, device, backend)
    return ctx, device


def peak_gpu_bytes(device: str) -> int | None:
    """Peak bytes the CUDA caching allocator handed out on `device` (None on CPU ranks)."""
    return int(torch.cuda.max_memory_allocated(device)) if device.startswith("cuda") else None


def _build(launch: RankLaunch, ctx: ParallelContext, device: str) -> RankModel:
    """This rank's model; running out of GPU memory is named with the fix."""
    spec = launch.spec
    try:
        return build_rank_model(spec, launch.source, ctx, launch.settings, device)
    except torch.cuda.OutOfMemoryError as e:  # torch.OutOfMemoryError, under its older name
        if device == "cpu":
            raise
        free, total = torch.cuda.mem_get_info(device)
        raise DeviceError(f"rank {spec.rank} ran out of memory on {device} while loading its part of the model "
                          f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB free after the failure); stream layers "
                          "from host memory (--memory-budget SIZE), use more ranks (--tp), or quantize "
                          "(--quantization int4)") from e


def _ready_report(rank: RankModel, device: str, runner: SlotRunner) -> dict[str, Any]:
    """What a rank tells the driver once it is loaded."""
    return {"load_s": rank.stats.load_s, "peak_rss_bytes": peak_rss_bytes(), "device": device,
            "peak_gpu_bytes": peak_gpu_bytes(device), "rss_before_load_bytes": rank.stats.rss_before_load,
            "weight_bytes": rank.resident_bytes(), "streamed_layers": list(rank.streamed),
            "streamed_bytes_per_step": rank.streamed_bytes_per_step(), "kernels": rank.kernels.describe(),
            "kv_cache_bytes": runner.cache.nbytes(), "prefill_alone": not rank.kernels.shared_prefill}


def _serve(launch: RankLaunch, inbox, outbox, listener) -> None:
    t0 = time.perf_counter()
    ctx, device = _setup(launch, listener)
    rank = _build(launch, ctx, device)
    runner = SlotRunner(rank, ctx)
    ctx.stats.clear()  # collectives of the load (quantization statistics) are not a request's traffic
    dist.barrier()
    rank.stats.load_s = time.perf_counter() - t0
    outbox.put(("ready", launch.spec.rank, _ready_report(rank, device, runner)))
    fixed = fixed_stats(rank, runner)
    try:
        serve_steps(runner, inbox, outbox, launch.spec.rank, lambda: rank_stats(rank, ctx, runner, fixed))
    finally:
        rank.close()
        if ctx.shm is not None:
            ctx.shm.close()
        dist.destroy_process_group()


def fixed_stats(rank: RankModel, runner: SlotRunner) -> dict[str, int] | None:
    """The counters that cannot change after loading (weights held, KV cache, bytes streamed per step), counted
    once: walking every module for the weight bytes takes milliseconds a poll should not. None for a rank that
    streams offloaded layers, whose resident weights change as layers come and go."""
    return None if rank.streamer is not None else _weight_counts(rank, runner)


def _weight_counts(rank: RankModel, runner: SlotRunner) -> dict[str, int]:
    return {"weight_bytes": rank.resident_bytes(), "kv_cache_bytes": runner.cache.nbytes(),
            "streamed_bytes": rank.streamed_bytes_per_step()}


def rank_stats(rank: RankModel, ctx: ParallelContext, runner: SlotRunner,
               fixed: dict[str, int] | None = None) -> dict[str, Any]:
    """This rank's counters so far: memory, collectives per op, streaming, steps run ahead (`fixed`: those counted
    at load)."""
    streamer, device = rank.streamer, str(rank.device)
    gpu = device.startswith("cuda")
    fixed = fixed or _weight_counts(rank, runner)
    return {"peak_rss_bytes": peak_rss_bytes(), "peak_gpu_bytes": peak_gpu_bytes(device), "rss_bytes": rss_bytes(),
            "comms": ctx.snapshot(), **fixed, "steps": runner.clock.as_dict(),
            "gpu_allocated_bytes": int(torch.cuda.memory_allocated(device)) if gpu else None,
            "gpu_reserved_bytes": int(torch.cuda.memory_reserved(device)) if gpu else None,
            "streaming": streamer.stats.as_dict() if streamer is not None else None,
            "run_ahead": runner.ahead.counts() if runner.ahead is not None else None}


def rss_bytes() -> int:
    """This process's resident set size now (VmRSS), in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
