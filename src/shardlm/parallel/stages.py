"""Pipeline stages as plain data: which layers each stage runs and how a batch is cut into micro-batches.

Torch-free, so the driver and the planner use it; the process groups and neighbours of a stage are
set up in `parallel/pipeline.py`, in the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

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
