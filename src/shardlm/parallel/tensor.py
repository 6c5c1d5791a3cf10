"""Tensor-parallel styles: which slice of each weight a rank owns, and the layers that use them.

A style answers two questions for one module: which slice of its checkpoint tensors a rank owns
(`slices`, used by the loader and the sharder alike) and which module replaces it on that rank
(`build`). The family's TP plan maps module-name patterns to styles; `parallelize` applies it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.kernels import local_linear
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.split import HeadSplit, split_range, split_sizes


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

    def build(self, module: nn.Module, coord: ShardCoord, ctx: ParallelContext) -> nn.Module:
        """A replacement for `module` (on the meta device) holding only this rank's part."""


def _rows(start: int, stop: int, shape: tuple[int, ...]) -> Slices:
    return (slice(start, stop),) + tuple(slice(0, n) for n in shape[1:])


def _full(shape: tuple[int, ...]) -> Slices:
    return tuple(slice(0, n) for n in shape)


def _linear(in_f: int, out_f: int, bias: bool) -> nn.Linear:
    with torch.device("meta"):
        return nn.Linear(in_f, out_f, bias=bias)


@dataclass(frozen=True)
class ColwiseHeads:
    """Column-parallel q/k/v: Y_r = X W_r^T + b_r where W_r holds the rows of this rank's heads.

    `which` = "q" takes the rank's query heads; "kv" takes the KV heads those query heads read
    (`HeadSplit.kv_range`). Output stays sharded by head; no communication.
    """

    which: str

    def _range(self, coord: ShardCoord) -> tuple[int, int]:
        a, b = coord.heads.q_range(coord.rank) if self.which == "q" else coord.heads.kv_range(coord.rank)
        return a * coord.head_dim, b * coord.head_dim

    def slices(self, param, shape, coord):
        """Rows of this rank's heads, for the weight and the bias alike."""
        return _rows(*self._range(coord), shape)

    def build(self, module, coord, ctx):
        """A plain Linear with this rank's output rows."""
        a, b = self._range(coord)
        return _linear(module.in_features, b - a, module.bias is not None)


class EvenRows:
    """Styles whose tensors are split along dim 0 into nearly equal chunks (weight and bias alike)."""

    def slices(self, param, shape, coord):
        """Rows [start, stop) of `split_range(shape[0], tp, rank)`."""
        return _rows(*split_range(shape[0], coord.tp, coord.rank), shape)


@dataclass(frozen=True)
class Colwise(EvenRows):
    """Column-parallel linear over a plain dimension (MLP gate/up): output rows split nearly evenly."""

    def build(self, module, coord, ctx):
        """A plain Linear with this rank's output rows."""
        a, b = split_range(module.out_features, coord.tp, coord.rank)
        return _linear(module.in_features, b - a, module.bias is not None)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r W_r^T + b: each rank multiplies its input columns, one all-reduce sums them.

    The input X arrives already split by column (the output of a column-parallel layer), so
    X W^T = sum over ranks of X_r W_r^T exactly. The bias is replicated and added once, after
    the reduction.
    """

    def __init__(self, in_local: int, out_features: int, bias: bool, ctx: ParallelContext,
                 in_start: int = 0, in_total: int | None = None):
        super().__init__()
        self.in_start = in_start
        """First input column of the full weight this rank holds (quantization groups count from 0)."""
        self.in_total = in_local if in_total is None else in_total
        """Input columns of the full weight."""
        with torch.device("meta"):
            self.weight = nn.Parameter(torch.empty(out_features, in_local))
            self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_local) -> (..., out_features), identical on every rank."""
        y = self.ctx.all_reduce(local_linear(self, x))
        return y + self.bias if self.bias is not None else y


@dataclass(frozen=True)
class RowwiseHeads:
    """Row-parallel o_proj: input columns are this rank's query heads (see RowParallelLinear)."""

    def slices(self, param, shape, coord):
        """Columns of this rank's query heads for the weight; the whole bias."""
        if param == "bias":
            return _full(shape)
        a, b = coord.heads.q_range(coord.rank)
        return (slice(0, shape[0]), slice(a * coord.head_dim, b * coord.head_dim))

    def build(self, module, coord, ctx):
        """RowParallelLinear over this rank's head columns."""
        a, b = coord.heads.q_range(coord.rank)
        return RowParallelLinear((b - a) * coord.head_dim, module.out_features, module.bias is not None, ctx,
                                 a * coord.head_dim, module.in_features)


@dataclass(frozen=True)
class Rowwise:
    """Row-parallel linear over a plain dimension (MLP down): input columns split nearly evenly."""

    def slices(self, param, shape, coord):
        """Columns [start, stop) of `split_range(in_features, tp, rank)`; the whole bias."""
        if param == "bias":
            return _full(shape)
        a, b = split_range(shape[1], coord.tp, coord.rank)
        return (slice(0, shape[0]), slice(a, b))

    def build(self, module, coord, ctx):
        """RowParallelLinear over this rank's columns."""
        a, b = split_range(module.in_features, coord.tp, coord.rank)
        return RowParallelLinear(b - a, module.out_features, module.bias is not None, ctx, a, module.in_features)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (token ids [start, stop)) are split across ranks.

    Each rank looks up the ids it owns and writes zeros for the others; the all-reduce sum then
    yields every token's full embedding row on every rank.
    """

    def __init__(self, start: int, stop: int, dim: int, ctx: ParallelContext):
        super().__init__()
        with torch.device("meta"):
            self.weight = nn.Parameter(torch.empty(stop - start, dim))
        self.start, self.stop, self.ctx = start, stop, ctx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (b, s) -> (b, s, dim)."""
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)  # (b, s, dim)
        return self.ctx.all_reduce(out)


class VocabParallelHead(nn.Module):
    """LM head whose output rows (vocabulary) are split; an all-gather joins the logit columns."""

    packable = True

    def __init__(self, start: int, stop: int, dim: int, sizes: list[int], ctx: ParallelContext):
        super().__init__()
        self.out_features = stop - start
        with torch.device("meta"):
            self.weight = nn.Parameter(torch.empty(stop - start, dim))
        self.sizes, self.ctx = sizes, ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s, dim) -> logits (b, s, vocab), identical on every rank."""
        return self.ctx.all_gather(local_linear(self, x), dim=-1, sizes=self.sizes)


@dataclass(frozen=True)
class VocabEmbedding(EvenRows):
    """Vocabulary-parallel embedding rows."""

    def build(self, module, coord, ctx):
        """VocabParallelEmbedding over this rank's ids."""
        a, b = split_range(module.num_embeddings, coord.tp, coord.rank)
        return VocabParallelEmbedding(a, b, module.embedding_dim, ctx)


@dataclass(frozen=True)
class VocabHead(EvenRows):
    """Vocabulary-parallel LM head rows (the same split as VocabEmbedding, so tied weights align)."""

    def build(self, module, coord, ctx):
        """VocabParallelHead over this rank's ids."""
        a, b = split_range(module.out_features, coord.tp, coord.rank)
        return VocabParallelHead(a, b, module.in_features, split_sizes(module.out_features, coord.tp), ctx)


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
        return _full(shape)
    return style.slices(kind, shape, coord)


def parallelize(model: nn.Module, plan: dict[str, Style], coord: ShardCoord, ctx: ParallelContext) -> None:
    """Swap every module matched by `plan` for its rank-local replacement (model on meta)."""
    if coord.tp == 1:
        return
    for name, module in list(model.named_modules()):
        style = style_for(name, plan)
        if style is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, style.build(module, coord, ctx))
