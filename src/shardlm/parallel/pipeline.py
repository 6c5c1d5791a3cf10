"""Pipeline stages at run time: the process groups and neighbours of each rank (layers per stage: stages.py).

World = tp x pp ranks, numbered stage-major as in `plan.layout.ParallelLayout`:
    rank = stage * tp + tp_rank
The tp ranks of a stage form one process group (their all-reduces); rank (stage, r) passes hidden
states to (stage + 1, r), and the last stage's rank r returns sampled tokens to (0, r). Every tp
rank of a stage holds the full hidden state after its all-reduce, so each pair link carries it
whole and no stage needs a gather or scatter.
"""

from __future__ import annotations

import torch.distributed as dist

from shardlm.parallel.context import ParallelContext, PipePeers


def pipeline_context(rank: int, tp: int, pp: int, shm_bytes: int = 0, timeout_s: float = 300.0,
                     nccl: bool = False) -> ParallelContext:
    """Build this rank's ParallelContext on an initialized world of tp x pp ranks.

    Every rank must call it (process groups are created collectively, in the same order). With
    `shm_bytes` > 0 the tp ranks of a stage also get a shared-memory transport for their collectives.
    `nccl`: the world runs on NCCL (CUDA tensors in collectives). Stages then also get a gloo group
    for the small host-side messages (headers, sampled tokens) that go back and forth: on one NCCL
    communicator, a send may wait for its matching receive, and the two directions between a pair
    of stages would be posted in crossing orders; hidden states alone then use NCCL, one way.
    """
    world = dist.get_world_size()
    if world != tp * pp:
        raise ValueError(f"the process group has {world} ranks but tp {tp} x pp {pp} needs {tp * pp}")
    stage, tp_rank = divmod(rank, tp)
    group = None
    if pp > 1:
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        group = groups[stage]
    shm = None
    if shm_bytes > 0 and tp > 1:
        from shardlm.parallel.shm import ShmCollectives

        shm = ShmCollectives.from_group(group or dist.group.WORLD, shm_bytes, timeout_s=timeout_s)
    pipe = None
    if pp > 1:
        pipe = PipePeers(stage=stage, n_stages=pp,
                         prev=rank - tp if stage > 0 else None,
                         next=rank + tp if stage < pp - 1 else None,
                         first=tp_rank, last=(pp - 1) * tp + tp_rank)
    host_group = dist.new_group(list(range(world)), backend="gloo") if nccl and pp > 1 else None
    return ParallelContext(rank=tp_rank, world=tp, group=group, shm=shm, pipe=pipe, cuda_collectives=nccl,
                           host_group=host_group)
