"""Build one rank's model: construct on meta, apply tensor parallelism, load only its own slices."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.checkpoint.reads import param_reads, rank_meta_model
from shardlm.checkpoint.source import CheckpointError, open_source
from shardlm.kernels import prepare_linears
from shardlm.models.args import ModelArgs
from shardlm.models.registry import Family
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.pipeline import StageSpec
from shardlm.parallel.tensor import ShardCoord


def shard_coord(args: ModelArgs, rank: int, tp: int) -> ShardCoord:
    """The ShardCoord of `rank` in a TP group of `tp` for this model."""
    return ShardCoord.for_model(args, rank, tp)


def build_rank_model(folder, family: Family, args: ModelArgs, coord: ShardCoord, ctx: ParallelContext,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     kernels: str | None = None, stage: StageSpec | None = None, rank: int | None = None) -> nn.Module:
    """This rank's part of the model, with weights read from `folder`; no full tensor is read.

    `folder` is an ordinary checkpoint (each rank slices what it owns) or per-rank files written by
    `shardlm shard` (global `rank` then opens only its own files). `stage` keeps only one pipeline
    stage's layers (and the embedding or head where it has them). On CPU the linear layers are
    routed through `kernels.prepare_linears` (`kernels` picks the mode: "gemv", "onednn", "torch";
    default: $SHARDLM_KERNELS or the fastest available).
    """
    model = rank_meta_model(family, args, coord, stage, ctx)
    with open_source(folder, coord.rank if rank is None else rank) as src:
        for name, read in param_reads(model, family, coord, src.shape):
            param = model.get_parameter(name)
            if read.local_shape != tuple(param.shape):
                raise CheckpointError(
                    f"tensor {read.name!r} in {src.files[read.name]} has shape {list(read.shape)}, which does not "
                    f"match config.json (this rank expects a {list(param.shape)} slice of it); the config and the "
                    "weights come from different models")
            value = src.read(read.name, read.slices).to(device=device, dtype=dtype)
            _set_param(model, name, nn.Parameter(value, requires_grad=False))
    for target, source in model.tied_weight_names().items():
        _set_param(model, target, model.get_parameter(source))
    model.reset_buffers(device)
    if coord.tp > 1:
        for module in model.modules():
            if hasattr(module, "set_kv_map"):
                module.set_kv_map(coord.heads.kv_map(coord.rank).tolist(), device)
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        prepare_linears(model, kernels)
    return model


def _set_param(model: nn.Module, name: str, value: nn.Parameter) -> None:
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    module._parameters[pname] = value
