"""run_on_ranks: ranks forked from a server that imported torch once, each with its threads, rank and group,
and a failing or vanished rank reported by number."""

from __future__ import annotations

import os
import time

import pytest

from shardlm.parallel.launch import RanksFailed, rank_context, run_on_ranks, start_fork_server, stop_fork_server


def _describe(rank: int, world: int) -> tuple:
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return rank, world, torch.get_num_threads(), int(total), os.getpid()


def _raise_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError(f"rank {rank} was told to fail")
    return rank


def _exit_on_one(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)
    import torch.distributed as dist

    dist.barrier()  # never passes: rank 1 is gone
    return rank


def test_gloo_ranks_fork_from_the_server_and_nccl_ranks_are_spawned():
    assert rank_context().get_start_method() == "forkserver"
    assert rank_context(cuda=True).get_start_method() == "spawn"


def _tunables(rank: int, world: int) -> tuple:
    return os.environ.get("GLIBC_TUNABLES") or "", os.getppid()


def test_ranks_fork_with_the_servers_huge_pages_and_others_are_spawned():
    """The server's malloc tunables are fixed when it starts; a rank that wants the other setting is spawned."""
    server = start_fork_server()
    assert start_fork_server(not server) == server  # the first start decides
    assert rank_context(huge_pages=server).get_start_method() == "forkserver"
    assert rank_context(huge_pages=not server).get_start_method() == "spawn"
    got = run_on_ranks(_tunables, 2, timeout_s=120)
    assert all(("glibc.malloc.hugetlb=1" in tunables) == server for tunables, _ in got), got
    assert len({parent for _, parent in got}) == 1 and got[0][1] != os.getpid()  # children of the server


def test_a_stopped_fork_server_is_started_again_by_the_next_ranks():
    """stop_fork_server (run at exit) kills the server at once; ranks started later get a new one."""
    from multiprocessing import forkserver

    import psutil

    start_fork_server()
    pid = forkserver._forkserver._forkserver_pid
    stop_fork_server()
    deadline = time.monotonic() + 30
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # killed, left for ensure_running to reap
    got = run_on_ranks(_tunables, 2, timeout_s=120)
    assert forkserver._forkserver._forkserver_pid != pid and got[0][1] == forkserver._forkserver._forkserver_pid


@pytest.mark.parametrize("world,threads", [(3, 1), (2, 2)])
def test_each_rank_has_its_rank_threads_and_group(world, threads):
    got = run_on_ranks(_describe, world, timeout_s=120, threads=threads)
    assert [g[:4] for g in got] == [(r, world, threads, world * (world + 1) // 2) for r in range(world)]
    assert len({g[4] for g in got} | {os.getpid()}) == world + 1  # a process of its own each


def test_a_raising_rank_is_reported_with_its_number_and_traceback():
    with pytest.raises(RanksFailed) as err:
        run_on_ranks(_raise_on_one, 2, timeout_s=60)
    assert "--- rank 1 ---" in str(err.value) and "ValueError: rank 1 was told to fail" in str(err.value)


def test_a_rank_that_exits_is_named_with_its_exit_code():
    with pytest.raises(RanksFailed) as err:
        run_on_ranks(_exit_on_one, 2, timeout_s=60)
    assert "--- rank 1 ---\ndied with exit code 3" in str(err.value)


@pytest.mark.parametrize("argv,starts", [
    (["generate", "x", "--tp", "2"], True), (["-v", "serve", "--tp", "2"], True),
    (["generate", "x", "--device", "cuda"], False), (["serve", "--device=cuda:1"], False),
    (["generate", "--help"], False), (["plan", "smollm2-135m"], False), (["generate", "--device"], True), ([], False),
])
def test_the_entry_point_starts_the_fork_server_for_commands_that_fork_cpu_ranks(argv, starts):
    from shardlm.__main__ import starts_cpu_ranks

    assert starts_cpu_ranks(argv) == starts
