"""Which slice of which checkpoint tensor each parameter of one rank's model comes from.

The loader (runtime/build.py) and the sharder (checkpoint/shard.py) both call `param_reads` on the
same meta model (`rank_meta_model`), so per-rank files hold exactly what a rank would slice out of
the ordinary checkpoint, and a rank loading them gets bitwise the same parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from shardlm.models.args import ModelArgs
from shardlm.models.registry import Family
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.stages import StageSpec
from shardlm.parallel.styles import ShardCoord, Slices, param_slices
from shardlm.parallel.tensor import parallelize


@dataclass(frozen=True)
class TensorRead:
    """One slice of one checkpoint tensor."""

    name: str
    """Tensor name in the checkpoint, e.g. "model.layers.3.mlp.up_proj.weight"."""
    shape: tuple[int, ...]
    """Full shape of the tensor in the checkpoint."""
    slices: Slices
    """[start, stop) along every dimension."""

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the slice."""
        return tuple(s.stop - s.start for s in self.slices)

    def ranges(self) -> list[list[int]]:
        """The slices as [[start, stop], ...] (for JSON)."""
        return [[s.start, s.stop] for s in self.slices]


def rank_meta_model(family: Family, args: ModelArgs, coord: ShardCoord, stage: StageSpec | None,
                    ctx: ParallelContext | None = None) -> nn.Module:
    """One rank's model on the meta device: its pipeline stage only, tensor-parallel layers swapped in."""
    with torch.device("meta"):
        model = family.model_class(args)
    if stage is not None:
        model.keep_stage(stage.start, stage.stop, stage.first, stage.last)
    parallelize(model, family.tp_plan, coord, ctx or ParallelContext(rank=coord.rank, world=coord.tp))
    return model


def needed_names(model: nn.Module, family: Family) -> list[tuple[str, str]]:
    """(parameter name, checkpoint tensor name) for every parameter the rank loads (tied aliases skipped)."""
    tied, aliases = model.tied_weight_names(), model.checkpoint_aliases()
    return [(name, family.checkpoint_name(aliases.get(name, name)))
            for name, _ in model.named_parameters(remove_duplicate=False) if name not in tied]


def param_reads(model: nn.Module, family: Family, coord: ShardCoord,
                full_shape: Callable[[str], tuple[int, ...] | None]) -> list[tuple[str, TensorRead]]:
    """(parameter name, what to read) for every parameter the rank loads; tied aliases are skipped.

    `full_shape(name)` gives a checkpoint tensor's full shape (from the file headers); a tensor for
    which it returns None is left out (callers that report missing tensors compare with `needed_names`).
    """
    out = []
    for name, ck_name in needed_names(model, family):
        shape = full_shape(ck_name)
        if shape is not None:
            shape = tuple(shape)
            out.append((name, TensorRead(ck_name, shape, param_slices(ck_name, shape, family.tp_plan, coord))))
    return out
