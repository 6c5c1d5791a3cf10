"""Collective latency on one host: gloo (torch.distributed, 127.0.0.1) vs shardlm's ShmCollectives.

    python bench/allreduce.py [--iters 2000] [--world 2]

Decode needs two all-reduces of one hidden vector (576 floats for SmolLM2-135M) per layer per token,
and one all-gather of vocab-parallel logits (49152 / 2 floats per rank) per token. Prints median and
p90 latency in microseconds, measured on rank 0, each op timed one call at a time, gloo and shm
interleaved in rounds so that load from other processes on the host hits both alike.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from shardlm.parallel.shm import ShmCollectives

HIDDEN = 576  # SmolLM2-135M hidden size
VOCAB = 49152  # SmolLM2 vocabulary
ROUNDS = 10


def _time(fn, iters: int, warmup: int, group) -> list[float]:
    for _ in range(warmup):
        fn()
    dist.barrier(group=group)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return samples


def _worker(rank: int, world: int, port: int, iters: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    group = dist.group.WORLD
    shard = VOCAB // world
    coll = ShmCollectives.from_group(group, max_bytes=shard * 4, timeout_s=60)
    vec, bf = torch.zeros(HIDDEN), torch.zeros(HIDDEN, dtype=torch.bfloat16)  # sums stay finite
    logits = torch.randn(shard)
    gather_buf = [torch.empty(shard) for _ in range(world)]

    def gloo_gather():
        dist.all_gather(gather_buf, logits, group=group)
        return torch.cat(gather_buf)

    cases = [
        (f"all_reduce {HIDDEN} fp32", lambda: dist.all_reduce(vec, group=group),
         lambda: coll.all_reduce_(vec)),
        (f"all_reduce {HIDDEN} bf16", lambda: dist.all_reduce(bf, group=group),
         lambda: coll.all_reduce_(bf)),
        (f"all_gather {shard}/rank fp32", gloo_gather, lambda: coll.all_gather(logits, dim=0)),
    ]
    rows = []
    for label, gloo_fn, shm_fn in cases:
        g, s = _time(gloo_fn, 0, iters // 10, group), _time(shm_fn, 0, iters // 10, group)
        for _ in range(ROUNDS):  # interleaved, so a burst of load on the host hits both alike
            g += _time(gloo_fn, iters // ROUNDS, 0, group)
            s += _time(shm_fn, iters // ROUNDS, 0, group)
        rows.append((label, g, s))
    coll.close()
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def _p(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100)[int(q) - 1] if q < 100 else max(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args.iters, out))
             for r in range(args.world)]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(f"world {args.world}, {args.iters} iterations after {args.iters // 10} warmup, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, python {sys.version.split()[0]}")
    print(f"{'op':<28}{'gloo p50 us':>12}{'shm p50 us':>12}{'speedup':>9}{'gloo p90':>10}{'shm p90':>9}")
    for label, g, s in rows:
        gm, sm = statistics.median(g), statistics.median(s)
        print(f"{label:<28}{gm:>12.1f}{sm:>12.1f}{gm / sm:>8.1f}x{_p(g, 90):>10.1f}{_p(s, 90):>9.1f}")


if __name__ == "__main__":
    main()
