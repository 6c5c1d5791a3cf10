"""Pipeline stages at run time: the process groups and neighbours of each rank.

Ranks, groups and neighbours come from the rank's RankSpec (`plan.rank_spec(rank)`: the numbering
is `plan.layout.ParallelLayout`'s, the only place it is defined); the rank passes them in. The tp ranks of a stage form one
process group (their all-reduces); rank (stage, r) passes hidden states to (stage + 1, r), and the
last stage's rank r returns sampled tokens to (0, r). Every tp rank of a stage holds the full
hidden state after its all-reduce, so each pair link carries it whole and no stage needs a gather
or scatter.
"""

from __future__ import annotations

import torch.distributed as dist

from shardlm.parallel.context import ParallelContext, PipePeers


def pipeline_context(rank: int, tp_groups: list[tuple[int, ...]] | tuple, pipe: PipePeers | None = None,
                     shm_bytes: int = 0, timeout_s: float = 300.0, nccl: bool = False) -> ParallelContext:
    """Build global `rank`'s ParallelContext on an initialized world: its tensor-parallel group is the one
    of `tp_groups` that holds it, `pipe` its pipeline neighbours (None without stages).

    Every rank must call it with the same `tp_groups` (process groups are created collectively, in
    the same order). With `shm_bytes` > 0 the tp ranks of a stage also get a shared-memory transport
    for their collectives. `nccl`: the world runs on NCCL (CUDA tensors in collectives). Stages then
    also get a gloo group for the small host-side messages (headers, sampled tokens) that go back and
    forth: on one NCCL communicator, a send may wait for its matching receive, and the two directions
    between a pair of stages would be posted in crossing orders; hidden states alone then use NCCL,
    one way.
    """
    world = dist.get_world_size()
    covered = sorted(r for g in tp_groups for r in g)
    if covered != list(range(world)):
        raise ValueError(f"the tensor-parallel groups {list(tp_groups)} do not cover the {world} ranks of the world once")
    mine = next(g for g in tp_groups if rank in g)
    group = None
    if len(tp_groups) > 1:
        groups = [dist.new_group(list(ranks)) for ranks in tp_groups]
        group = groups[list(tp_groups).index(mine)]
    shm = None
    if shm_bytes > 0 and len(mine) > 1:
        from shardlm.parallel.shm import ShmCollectives

        shm = ShmCollectives.from_group(group or dist.group.WORLD, shm_bytes, timeout_s=timeout_s)
    host_group = dist.new_group(list(range(world)), backend="gloo") if nccl and pipe is not None else None
    return ParallelContext(rank=mine.index(rank), world=len(mine), group=group, shm=shm, pipe=pipe,
                           cuda_collectives=nccl, host_group=host_group)
