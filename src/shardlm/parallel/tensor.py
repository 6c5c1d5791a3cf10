"""Tensor-parallel modules: the rank-local layers that hold a style's slices and run its collectives.

Which slice a rank owns is decided in `parallel/styles.py` (torch-free, shared with the sharder
and the planner); this module builds the replacement modules on the meta device and swaps them in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.kernels.linear import LinearOps, local_linear
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.split import split_range, split_sizes
from shardlm.parallel.styles import (Colwise, ColwiseHeads, Rowwise, RowwiseHeads, ShardCoord, Style, VocabEmbedding,
                                     VocabHead, style_for)


def _linear(in_f: int, out_f: int, bias: bool) -> nn.Linear:
    with torch.device("meta"):
        return nn.Linear(in_f, out_f, bias=bias)


class RowParallelLinear(LinearOps, nn.Module):
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
        """x (..., in_local) -> (..., out_features), identical on every rank. A quantized weight's partial sums
        come and are all-reduced in float64, then rounded once: what one rank's kernel rounds (shardlm.quant)."""
        y = self.ctx.all_reduce(local_linear(self, x, wide=True))
        if y.dtype != x.dtype:
            y = y.float().to(x.dtype)  # as the one-rank kernel: double -> float32 -> the model's dtype
        return y + self.bias if self.bias is not None else y


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


class VocabParallelHead(LinearOps, nn.Module):
    """LM head whose output rows (vocabulary) are split; an all-gather joins the logit columns."""

    def __init__(self, start: int, stop: int, dim: int, sizes: list[int], ctx: ParallelContext):
        super().__init__()
        self.out_features = stop - start
        with torch.device("meta"):
            self.weight = nn.Parameter(torch.empty(stop - start, dim))
        self.sizes, self.ctx = sizes, ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, s, dim) -> logits (b, s, vocab), identical on every rank."""
        return self.ctx.all_gather(local_linear(self, x), dim=-1, sizes=self.sizes)


def build_local(style: Style, module: nn.Module, coord: ShardCoord, ctx: ParallelContext) -> nn.Module:
    """A replacement for `module` (on the meta device) holding only this rank's part under `style`.

    Column-parallel styles become plain Linears with the rank's output rows; row-parallel ones a
    RowParallelLinear over its input columns; the vocabulary styles the vocabulary-parallel
    embedding and head over its ids.
    """
    bias = getattr(module, "bias", None) is not None
    if isinstance(style, ColwiseHeads):
        a, b = style.out_range(coord)
        return _linear(module.in_features, b - a, bias)
    if isinstance(style, Colwise):
        a, b = style.out_range(module.out_features, coord)
        return _linear(module.in_features, b - a, bias)
    if isinstance(style, RowwiseHeads):
        a, b = style.in_range(coord)
        return RowParallelLinear(b - a, module.out_features, bias, ctx, a, module.in_features)
    if isinstance(style, Rowwise):
        a, b = style.in_range(module.in_features, coord)
        return RowParallelLinear(b - a, module.out_features, bias, ctx, a, module.in_features)
    if isinstance(style, VocabEmbedding):
        a, b = split_range(module.num_embeddings, coord.tp, coord.rank)
        return VocabParallelEmbedding(a, b, module.embedding_dim, ctx)
    if isinstance(style, VocabHead):
        a, b = split_range(module.out_features, coord.tp, coord.rank)
        return VocabParallelHead(a, b, module.in_features, split_sizes(module.out_features, coord.tp), ctx)
    raise TypeError(f"no rank-local module for style {style!r}")


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
        setattr(parent, child, build_local(style, module, coord, ctx))
