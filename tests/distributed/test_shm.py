"""ShmCollectives across real rank processes (forked from the ranks' fork server): sums, bitwise agreement,
uneven gathers, dead peers."""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import socket
import time
import traceback
import uuid

import pytest
import torch

from shardlm.parallel.launch import rank_context
from shardlm.parallel.shm import ShmCollectives

JOIN_TIMEOUT_S = 120.0
MAX_ELEMS = 4096


def _entry(fn, rank: int, world: int, args: tuple, results) -> None:
    try:
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # report every failure, with its traceback, to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, dead: set = frozenset(), timeout_s: float = JOIN_TIMEOUT_S) -> list:
    """Run fn(rank, world, *args) in `world` processes forked from the ranks' fork server; return results by
    rank (None for the ranks in `dead`, which are expected to die) or fail with every rank's traceback. Every
    wait has a deadline; stragglers are killed."""
    ctx = rank_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline, got = time.monotonic() + timeout_s, {}
    try:
        while len(got) < world - len(dead) and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
                got[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(got.items()) if s == "error"]
    missing = [r for r in range(world) if r not in got and r not in dead]
    if errors or missing:
        codes = {r: procs[r].exitcode for r in missing}
        pytest.fail(f"ranks without a result (exit codes): {codes}\n" + "\n".join(errors))
    return [got[r][1] if r in got else None for r in range(world)]


def _data(step: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _reference_sum(step: int, world: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    acc = _data(step, 0, numel, dtype).float()  # the documented order: ranks 0..world-1 in float32
    for r in range(1, world):
        acc += _data(step, r, numel, dtype)
    return acc.to(dtype)


def _check_collectives(rank: int, world: int, name: str) -> str:
    coll = ShmCollectives(name, rank, world, max_bytes=MAX_ELEMS * 4, timeout_s=60, create=rank == 0)
    digest = hashlib.sha256()
    plan = torch.Generator().manual_seed(7)  # the same call sequence on every rank
    for step in range(200):
        numel = int(torch.randint(1, MAX_ELEMS + 1, (1,), generator=plan))
        kind = int(torch.randint(0, 3, (1,), generator=plan))
        if rank == step % world and step % 7 == 0:
            time.sleep(0.002)  # a slow rank: the others run ahead into the other buffer
        if kind < 2:
            dtype = (torch.float32, torch.bfloat16)[kind]
            out = coll.all_reduce_(_data(step, rank, numel, dtype))
            expected = _reference_sum(step, world, numel, dtype)
            assert torch.equal(out, expected), f"step {step}: all_reduce_ differs from the reference"
            sums = torch.stack([_data(step, r, numel, torch.float64) for r in range(world)]).sum(0)
            tol = 1e-5 if dtype == torch.float32 else 5e-2 * world
            assert torch.allclose(out.double(), sums.double(), atol=tol, rtol=tol)
        else:  # uneven shards along dim 1, like a vocab of 49151 split over ranks
            cols = [numel // world + (1 if r < numel % world else 0) for r in range(world)]
            mine = _data(step, rank, 2 * cols[rank], torch.float32).view(2, cols[rank])
            out = coll.all_gather(mine, dim=1)
            expected = torch.cat([_data(step, r, 2 * cols[r], torch.float32).view(2, cols[r])
                                  for r in range(world)], dim=1)
            assert torch.equal(out, expected), f"step {step}: all_gather differs"
        digest.update(out.contiguous().view(torch.uint8).numpy().tobytes())
    base = torch.arange(12, dtype=torch.float32).view(3, 4) * (rank + 1)
    view = base.t()  # non-contiguous, reduced in place through its strides
    coll.all_reduce_(view)
    assert torch.equal(base, torch.arange(12, dtype=torch.float32).view(3, 4) * sum(range(1, world + 1)))
    coll.close()
    coll.close()  # idempotent
    return digest.hexdigest()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_reference_and_agree_bitwise(world):
    name = f"shardlm_test_{uuid.uuid4().hex[:12]}"
    digests = run_ranks(_check_collectives, world, name)
    assert len(set(digests)) == 1, "ranks ended with different bits"
    assert not os.path.exists(f"/dev/shm/{name}"), "segment left behind after close()"


def _dead_peer(rank: int, world: int, name: str) -> float:
    coll = ShmCollectives(name, rank, world, max_bytes=1024, timeout_s=3.0, create=rank == 0)
    for _ in range(5):
        coll.all_reduce_(torch.ones(16))
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies without a word, like an OOM-killed worker
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"peer ranks \[{world - 1}\].*3.0 s"):
        coll.all_reduce_(torch.ones(16))
    elapsed = time.monotonic() - start
    coll.close()
    return elapsed


def test_dead_peer_detected_within_timeout():
    name = f"shardlm_test_{uuid.uuid4().hex[:12]}"
    elapsed = run_ranks(_dead_peer, 3, name, dead={2})
    for rank in (0, 1):
        assert 2.9 <= elapsed[rank] < 6.0, f"rank {rank} noticed after {elapsed[rank]:.2f} s; timeout 3 s"
    assert not os.path.exists(f"/dev/shm/{name}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _from_group(rank: int, world: int, port: int) -> tuple[str, bool, list]:
    import torch.distributed as dist
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        coll = ShmCollectives.from_group(dist.group.WORLD, max_bytes=4096, timeout_s=30)
        out = coll.all_reduce_(torch.full((4,), float(rank + 1), dtype=torch.bfloat16))
        unlinked = not os.path.exists(f"/dev/shm/{coll.name}")  # rank 0 unlinked before this step
        gathered = coll.all_gather(torch.full((rank + 1,), float(rank)), dim=0)
        coll.close()
        return coll.name, unlinked, [out.float().tolist(), gathered.tolist()]
    finally:
        dist.destroy_process_group()


def test_from_group_creates_attaches_and_unlinks_early():
    results = run_ranks(_from_group, 2, _free_port())
    assert results[0][0] == results[1][0]
    assert all(unlinked for _, unlinked, _ in results), "from_group should unlink the name once attached"
    for _, _, (summed, gathered) in results:
        assert summed == [3.0] * 4
        assert gathered == [0.0, 1.0, 1.0]


def test_single_process_errors_and_close():
    name = f"shardlm_test_{uuid.uuid4().hex[:12]}"
    coll = ShmCollectives(name, 0, 1, max_bytes=64, create=True)
    assert torch.equal(coll.all_reduce_(torch.ones(16)), torch.ones(16))
    with pytest.raises(ValueError, match="max_bytes=64"):
        coll.all_reduce_(torch.ones(17))
    with pytest.raises(ValueError, match="supports"):
        coll.all_reduce_(torch.ones(4, dtype=torch.int64))
    assert os.path.exists(f"/dev/shm/{name}")
    coll.close()
    coll.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(RuntimeError, match="after close"):
        coll.all_reduce_(torch.ones(4))
    with pytest.raises(ValueError, match="outside world"):
        ShmCollectives(name, 2, 2, max_bytes=64, create=False)


def test_attach_with_other_max_bytes_is_refused():
    name = f"shardlm_test_{uuid.uuid4().hex[:12]}"
    owner = ShmCollectives(name, 0, 2, max_bytes=64, create=True)
    try:
        with pytest.raises(ValueError, match="same world and max_bytes"):
            ShmCollectives(name, 1, 2, max_bytes=128, timeout_s=1, create=False)
        with pytest.raises(TimeoutError, match="did not appear"):
            ShmCollectives(name + "_missing", 1, 2, max_bytes=64, timeout_s=0.2, create=False)
    finally:
        owner.close()
    assert not os.path.exists(f"/dev/shm/{name}")
