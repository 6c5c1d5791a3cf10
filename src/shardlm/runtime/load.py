"""Build one rank's model: construct on meta, apply tensor parallelism, load only its own slices."""

from __future__ import annotations

import torch
from torch import nn

from shardlm.kernels import prepare_linears
from shardlm.checkpoint.source import CheckpointError, CheckpointSource
from shardlm.models.args import ModelArgs
from shardlm.models.registry import Family
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.pipeline import StageSpec
from shardlm.parallel.tensor import ShardCoord, param_slices, parallelize


def shard_coord(args: ModelArgs, rank: int, tp: int) -> ShardCoord:
    """The ShardCoord of `rank` in a TP group of `tp` for this model."""
    return ShardCoord.for_model(args, rank, tp)


def build_rank_model(folder, family: Family, args: ModelArgs, coord: ShardCoord, ctx: ParallelContext,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     kernels: str | None = None, stage: StageSpec | None = None) -> nn.Module:
    """This rank's part of the model, with weights read from `folder`; no full tensor is read.

    `stage` keeps only one pipeline stage's layers (and the embedding or head where it has them);
    no tensor of another stage is read. On CPU the linear layers are routed through
    `kernels.prepare_linears` (`kernels` picks the mode: "gemv", "onednn", "torch"; default:
    $SHARDLM_KERNELS or the fastest available).
    """
    with torch.device("meta"):
        model = family.model_class(args)
    if stage is not None:
        model.keep_stage(stage.start, stage.stop, stage.first, stage.last)
    parallelize(model, family.tp_plan, coord, ctx)
    with CheckpointSource(folder) as src:
        _load_params(model, family, src, coord, dtype, device)
    model.reset_buffers(device)
    if coord.tp > 1:
        for module in model.modules():
            if hasattr(module, "set_kv_map"):
                module.set_kv_map(coord.heads.kv_map(coord.rank).tolist(), device)
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        prepare_linears(model, kernels)
    return model


def _load_params(model: nn.Module, family: Family, src: CheckpointSource, coord: ShardCoord,
                 dtype: torch.dtype, device) -> None:
    tied, aliases = model.tied_weight_names(), model.checkpoint_aliases()
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if name in tied:
            continue
        ck_name = family.checkpoint_name(aliases.get(name, name))
        shape = src.shape(ck_name)
        slices = param_slices(ck_name, shape, family.tp_plan, coord)
        local = tuple(s.stop - s.start for s in slices)
        if local != tuple(param.shape):
            raise CheckpointError(
                f"tensor {ck_name!r} in {src.files[ck_name]} has shape {list(shape)}, which does not match "
                f"config.json (this rank expects a {list(param.shape)} slice of it); the config and the "
                "weights come from different models"
            )
        value = src.read(ck_name, slices).to(device=device, dtype=dtype)
        _set_param(model, name, nn.Parameter(value, requires_grad=False))
    for target, source in tied.items():
        _set_param(model, target, model.get_parameter(source))


def _set_param(model: nn.Module, name: str, value: nn.Parameter) -> None:
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    module._parameters[pname] = value
