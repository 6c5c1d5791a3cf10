"""Tensor-parallel styles: which slice of each weight a rank owns (plain data, no torch).

A style answers one question for one module: which slice of its checkpoint tensors a rank owns
(`slices`). The loader, the sharder and the planner all ask it, so the slicing rules live here
once; the family's TP plan maps module-name patterns to styles. The rank-local modules that hold
those slices (and run the collectives) are in `parallel/tensor.py`, which the ranks import; the
driver and the planner import only this module and so never pay for torch.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Protocol

from shardlm.parallel.split import HeadSplit, block_range, split_range


@dataclass(frozen=True)
class ShardCoord:
    """Where a rank sits in its tensor-parallel group, plus the head layout the styles split."""

    rank: int
    tp: int
    heads: HeadSplit
    head_dim: int

    @classmethod
    def for_model(cls, args, rank: int, tp: int) -> "ShardCoord":
        """The coordinate of `rank` in a TP group of `tp` for a model with `args` (n_heads, n_kv_heads, head_dim)."""
        return cls(rank, tp, HeadSplit(args.n_heads, args.n_kv_heads, tp), args.head_dim)

    def local_kv_heads(self) -> int:
        """KV heads this rank holds (its KV-cache width in heads)."""
        a, b = self.heads.kv_range(self.rank)
        return b - a


Slices = tuple[slice, ...]


class Style(Protocol):
    """A tensor-parallel layout for one module."""

    def slices(self, param: str, shape: tuple[int, ...], coord: ShardCoord) -> Slices:
        """Slice of the full checkpoint tensor `param` ("weight"/"bias") of `shape` this rank owns."""


def _rows(start: int, stop: int, shape: tuple[int, ...]) -> Slices:
    return (slice(start, stop),) + tuple(slice(0, n) for n in shape[1:])


def full_slices(shape: tuple[int, ...]) -> Slices:
    """The whole tensor of `shape`."""
    return tuple(slice(0, n) for n in shape)


@dataclass(frozen=True)
class ColwiseHeads:
    """Column-parallel q/k/v: Y_r = X W_r^T + b_r where W_r holds the rows of this rank's heads.

    `which` = "q" takes the rank's query heads; "kv" takes the KV heads those query heads read
    (`HeadSplit.kv_range`). Output stays sharded by head; no communication.
    """

    which: str

    def out_range(self, coord: ShardCoord) -> tuple[int, int]:
        """[start, stop) output rows of this rank: its heads times the head size."""
        a, b = coord.heads.q_range(coord.rank) if self.which == "q" else coord.heads.kv_range(coord.rank)
        return a * coord.head_dim, b * coord.head_dim

    def slices(self, param, shape, coord):
        """Rows of this rank's heads, for the weight and the bias alike."""
        return _rows(*self.out_range(coord), shape)


class EvenRows:
    """Styles whose tensors are split along dim 0 into nearly equal chunks (weight and bias alike)."""

    def slices(self, param, shape, coord):
        """Rows [start, stop) of `split_range(shape[0], tp, rank)`."""
        return _rows(*split_range(shape[0], coord.tp, coord.rank), shape)


@dataclass(frozen=True)
class Colwise:
    """Column-parallel linear over a plain dimension (MLP gate/up): output rows split nearly evenly in whole blocks
    (`split.block_range`), the columns the row-parallel down projection then takes."""

    def out_range(self, out_features: int, coord: ShardCoord) -> tuple[int, int]:
        """[start, stop) output rows of this rank."""
        return block_range(out_features, coord.tp, coord.rank)

    def slices(self, param, shape, coord):
        """Rows of `out_range`, for the weight and the bias alike."""
        return _rows(*self.out_range(shape[0], coord), shape)


@dataclass(frozen=True)
class RowwiseHeads:
    """Row-parallel o_proj: input columns are this rank's query heads (see tensor.RowParallelLinear)."""

    def in_range(self, coord: ShardCoord) -> tuple[int, int]:
        """[start, stop) input columns of this rank: its query heads times the head size."""
        a, b = coord.heads.q_range(coord.rank)
        return a * coord.head_dim, b * coord.head_dim

    def slices(self, param, shape, coord):
        """Columns of this rank's query heads for the weight; the whole bias."""
        if param == "bias":
            return full_slices(shape)
        return (slice(0, shape[0]), slice(*self.in_range(coord)))


@dataclass(frozen=True)
class Rowwise:
    """Row-parallel linear over a plain dimension (MLP down): input columns split nearly evenly in whole blocks."""

    def in_range(self, in_features: int, coord: ShardCoord) -> tuple[int, int]:
        """[start, stop) input columns of this rank (the rows Colwise gives the layer before)."""
        return block_range(in_features, coord.tp, coord.rank)

    def slices(self, param, shape, coord):
        """Columns of `in_range`; the whole bias."""
        if param == "bias":
            return full_slices(shape)
        return (slice(0, shape[0]), slice(*self.in_range(shape[1], coord)))


@dataclass(frozen=True)
class VocabEmbedding(EvenRows):
    """Vocabulary-parallel embedding rows."""


@dataclass(frozen=True)
class VocabHead(EvenRows):
    """Vocabulary-parallel LM head rows (the same split as VocabEmbedding, so tied weights align)."""


def style_for(module_name: str, plan: dict[str, Style]) -> Style | None:
    """The style whose pattern matches `module_name` (fnmatch, `*` for a layer index), or None."""
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module_name, pattern):
            return style
    return None


def param_slices(param_name: str, shape: tuple[int, ...], plan: dict[str, Style], coord: ShardCoord) -> Slices:
    """Slice of checkpoint tensor `param_name` (e.g. "model.layers.0.mlp.up_proj.weight") a rank owns."""
    module_name, _, kind = param_name.rpartition(".")
    style = style_for(module_name, plan)
    if style is None or coord.tp == 1:
        return full_slices(shape)
    return style.slices(kind, shape, coord)
