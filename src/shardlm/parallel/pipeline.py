"""Pipeline stages: which layers a rank runs, its process groups and neighbours, and micro-batches.

World = tp x pp ranks, numbered stage-major as in `plan.layout.ParallelLayout`:
    rank = stage * tp + tp_rank
The tp ranks of a stage form one process group (their all-reduces); rank (stage, r) passes hidden
states to (stage + 1, r), and the last stage's rank r returns sampled tokens to (0, r). Every tp
rank of a stage holds the full hidden state after its all-reduce, so each pair link carries it
whole and no stage needs a gather or scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from shardlm.parallel.context import ParallelContext, PipePeers
from shardlm.parallel.split import split_sizes


@dataclass(frozen=True)
class StageSpec:
    """The part of the model one pipeline stage builds."""

    start: int
    stop: int
    """Decoder layers [start, stop)."""
    first: bool
    """Holds the embedding (takes token ids)."""
    last: bool
    """Holds the final norm and the LM head (produces logits)."""

    @classmethod
    def of(cls, stage_layers: tuple[tuple[int, int], ...], stage: int) -> "StageSpec":
        """The spec of `stage` among `stage_layers` ([start, stop) per stage)."""
        a, b = stage_layers[stage]
        return cls(a, b, stage == 0, stage == len(stage_layers) - 1)


def stages_from_counts(counts: list[int] | tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """[start, stop) layer ranges from per-stage layer counts, e.g. [20, 10] -> ((0, 20), (20, 30))."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return tuple(out)


def even_stages(n_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges for `pp` stages differing by at most one layer (earlier stages take the extra one)."""
    return stages_from_counts(split_sizes(n_layers, pp))


def micro_batch_rows(batch: int, m: int) -> list[tuple[int, int]]:
    """[start, stop) rows of each of `m` micro-batches of a batch of `batch` sequences (nearly equal)."""
    out, start = [], 0
    for size in split_sizes(batch, m):
        out.append((start, start + size))
        start += size
    return out


def auto_micro_batches(batch: int, pp: int) -> int:
    """Micro-batches when the user gives none: one per stage (capped by the batch).

    With m >= pp micro-batches in flight every stage has work in steady-state decode (the sampled
    token of micro-batch j returns to stage 0 while the others are in the pipe); more only adds
    per-forward overhead. A prefill pass idles a fraction (pp - 1) / (m + pp - 1) of stage time.
    """
    return max(1, min(batch, pp))


def pipeline_context(rank: int, tp: int, pp: int, shm_bytes: int = 0, timeout_s: float = 300.0) -> ParallelContext:
    """Build this rank's ParallelContext on an initialized world of tp x pp ranks.

    Every rank must call it (process groups are created collectively, in the same order). With
    `shm_bytes` > 0 the tp ranks of a stage also get a shared-memory transport for their collectives.
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
    return ParallelContext(rank=tp_rank, world=tp, group=group, shm=shm, pipe=pipe)
