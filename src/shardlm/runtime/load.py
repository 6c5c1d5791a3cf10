"""Build one rank's model: construct on meta, apply tensor parallelism, load only its own slices."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from shardlm.checkpoint.reads import param_reads, rank_meta_model
from shardlm.checkpoint.headers import CheckpointError
from shardlm.checkpoint.source import open_source
from shardlm.kernels import FastLinear, prepare_linears
from shardlm.models.args import ModelArgs
from shardlm.models.registry import Family
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.stages import StageSpec
from shardlm.paths import default_offload_dir
from shardlm.parallel.styles import ShardCoord, param_slices
from shardlm.parallel.tensor import RowParallelLinear
from shardlm.checkpoint.quantized import read_quantized
from shardlm.models.args import read_config
from shardlm.quant import quantize_linear
from shardlm.quant_spec import QuantizationError, check_kind, checkpoint_quantization, is_quantizable
from shardlm.runtime.device_stream import DeviceStreamer, PinnedStore
from shardlm.runtime.offload import LayerStreamer, OffloadStore, plan_streaming, trim_heap


def shard_coord(args: ModelArgs, rank: int, tp: int) -> ShardCoord:
    """The ShardCoord of `rank` in a TP group of `tp` for this model."""
    return ShardCoord.for_model(args, rank, tp)


def build_rank_model(folder, family: Family, args: ModelArgs, coord: ShardCoord, ctx: ParallelContext,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     kernels: str | None = None, stage: StageSpec | None = None, rank: int | None = None,
                     quantization: str | None = None, memory_budget: int | None = None,
                     offload_dir: str | Path | None = None, prefetch: bool = True,
                     offload_io: str = "mmap", stream_last: int | None = None) -> nn.Module:
    """This rank's part of the model, with weights read from `folder`; no full tensor is read.

    `folder` is an ordinary checkpoint (each rank slices what it owns) or per-rank files written by
    `shardlm shard` (global `rank` then opens only its own files). `stage` keeps only one pipeline
    stage's layers (and the embedding or head where it has them). On CPU the linear layers are
    routed through `kernels.prepare_linears` (`kernels` picks the mode: "gemv", "onednn", "torch";
    default: $SHARDLM_KERNELS or the fastest available). `quantization` ("int8"/"int4") quantizes
    each linear weight as soon as it is read (see shardlm.quant), so the float model is never held.
    `memory_budget` (bytes of weights and read buffers) streams the layers that do not fit from a
    scratch file in `offload_dir` (see runtime/offload.py); each such layer is written out as soon as
    it is loaded, so the rank never holds more than its budget plus one layer. On a GPU `device`
    the budget is GPU memory, and the layers beyond it go to pinned host memory instead and are
    copied in on a side stream (runtime/device_stream.py). The streamer, when
    there is one, is `model.streamer`; `offload_io` is how it brings layers in ("mmap" or "read",
    see LayerStreamer). SHARDLM_OFFLOAD_UNCACHED=1 evicts streamed layers from the page cache
    after each use, so every step reads the disk (for benchmarks). `stream_last` streams exactly
    the stage's last that many layers instead of fitting a budget (a manifest's `offload.layers`).
    """
    quantization = None if quantization in (None, "none") else quantization
    stored = checkpoint_quantization(read_config(folder))
    if stored and quantization and quantization != stored:
        raise QuantizationError(f"{folder} holds {stored} weights (quantization_config in config.json); "
                                f"--quantization {quantization} cannot change them: drop the flag, or give the "
                                "float checkpoint")
    quantization = stored or quantization
    check_kind(quantization, device)
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu and quantization == "int4" and (capability := torch.cuda.get_device_capability(device)) < (8, 0):
        major, minor = capability
        raise QuantizationError(f"int4 weights need a GPU of compute capability 8.0 or later (the CUDA int4 kernel); "
                                f"{torch.cuda.get_device_name(device)} is {major}.{minor}; use --quantization int8")
    model = rank_meta_model(family, args, coord, stage, ctx)
    plan = plan_streaming(model, memory_budget, quantization, prefetch, dtype, stream_last, vocab_ok=not on_gpu) \
        if memory_budget or stream_last else None
    rank = coord.rank if rank is None else rank
    if on_gpu:  # the GPU tier: layers beyond the budget wait in pinned host memory
        store = PinnedStore() if plan and plan.streamed else None
    else:
        store = OffloadStore(Path(offload_dir or default_offload_dir()), rank) \
            if plan and (plan.streamed or plan.vocab) else None
    vocab: dict[str, tuple[int, int]] = {}
    try:
        extents = _load_weights(model, folder, family, args, coord, ctx, dtype, device, rank, quantization, store,
                                set(plan.streamed) if store else set(), stored is not None,
                                set(plan.vocab) if store else set(), vocab)
        if vocab:  # the embedding / LM head used in place: parameters that are views of the mapped file
            flat = store.mapped()
            for name, (offset, nbytes) in vocab.items():
                meta = model.get_parameter(name)
                p = nn.Parameter(flat[offset:offset + nbytes].view(dtype).view(meta.shape), requires_grad=False)
                p._shardlm_mapped = True
                _set_param(model, name, p)
    except BaseException:
        if store is not None:
            store.close()  # no scratch file outlives a failed load
        raise
    for target, source in model.tied_weight_names().items():
        _set_param(model, target, model.get_parameter(source))
    model.reset_buffers(device)
    if coord.tp > 1:
        for module in model.modules():
            if hasattr(module, "set_kv_map"):
                module.set_kv_map(coord.heads.kv_map(coord.rank), device)
    model.eval().requires_grad_(False)
    trim_heap()  # what reading, converting and quantizing freed
    if torch.device(device).type == "cpu":
        prepare_linears(model, kernels)
    if store is not None:
        order = [m for m in model.model.layers.values() if m in extents]
        model.streamer = DeviceStreamer(extents, order, torch.device(device), prefetch) if on_gpu else \
            LayerStreamer(store, extents, order, prefetch, offload_io, os.environ.get("SHARDLM_OFFLOAD_UNCACHED") == "1",
                          vocab, model.model.embed_tokens, model.lm_head)
        model.stream_plan = plan
    return model


def _load_weights(model: nn.Module, folder, family: Family, args: ModelArgs, coord: ShardCoord,
                  ctx: ParallelContext, dtype: torch.dtype, device, rank: int, quantization: str | None,
                  store: OffloadStore | None, streamed: set[int], prequantized: bool = False,
                  vocab_names: set[str] = frozenset(), vocab: dict | None = None) -> dict:
    """Read every parameter this rank owns, quantizing linear weights as they arrive (or reading
    them quantized from a `prequantized` checkpoint) and writing each streamed layer to `store`
    once its last tensor is in; returns {layer module: its extent}. Parameters in `vocab_names` go
    to `store` as soon as they are read; their (offset, bytes) are put in `vocab`."""
    # a tied LM head stays in `dtype` whether or not this rank also holds the embedding (a last
    # pipeline stage reads it as a copy): the same rule on every layout keeps tokens layout-free
    tied = {"lm_head.weight"} if args.tie_embeddings else set()
    extents: dict[nn.Module, object] = {}
    current: int | None = None

    def finish(i: int | None) -> None:
        if i is not None and i in streamed:
            layer = model.model.layers[str(i)]
            for sub_name, sub in list(layer.named_modules()):
                if type(sub) is nn.Linear:
                    _fast_linear(layer, sub_name)  # the module the hooks attach weights to, for good
            extents[layer] = store.add(layer)

    with open_source(folder, rank) as src:
        for name, read in param_reads(model, family, coord, src.shape):
            layer_id = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            if layer_id != current:
                finish(current)
                current = layer_id
            param = model.get_parameter(name)
            module_name, _, kind = name.rpartition(".")
            quantized_here = quantization and kind == "weight" and is_quantizable(module_name) and name not in tied
            if prequantized and quantized_here:
                module = _fast_linear(model, module_name)
                in_total = getattr(module, "in_total", param.shape[1])
                rows, cols = param_slices(read.name, (read.shape[0], in_total), family.tp_plan, coord)
                module.quant = read_quantized(src, read.name, quantization, rows, cols, in_total, device)
                module.weight = None
                continue
            if read.local_shape != tuple(param.shape):
                raise CheckpointError(
                    f"tensor {read.name!r} in {src.files[read.name]} has shape {list(read.shape)}, which does not "
                    f"match config.json (this rank expects a {list(param.shape)} slice of it); the config and the "
                    "weights come from different models")
            if name in vocab_names:  # straight to the file, a block of rows at a time
                vocab[name] = store.add_tensor(_row_blocks(src, read, device, dtype))
                continue
            value = src.read(read.name, read.slices).to(device=device, dtype=dtype)
            _set_param(model, name, nn.Parameter(value, requires_grad=False))
            if quantized_here:
                module = _fast_linear(model, module_name)
                row_parallel = isinstance(module, RowParallelLinear)
                quantize_linear(module, quantization, ctx if row_parallel else None)
        finish(current)
    return extents


def _row_blocks(src, read, device, dtype, block_bytes: int = 8 * 2**20):
    """Yield `read`'s slice of its tensor as consecutive blocks of rows of about `block_bytes`."""
    rows, rest = read.slices[0], read.slices[1:]
    per_row = max(1, torch.empty(0, dtype=dtype).element_size() * int(torch.Size(read.local_shape[1:]).numel()))
    step = max(1, block_bytes // per_row)
    for a in range(rows.start, rows.stop, step):
        yield src.read(read.name, (slice(a, min(rows.stop, a + step)), *rest)).to(device=device, dtype=dtype)


def _fast_linear(model: nn.Module, name: str) -> nn.Module:
    """The module `name`, a plain nn.Linear swapped for a FastLinear (whose forward reads `.quant`)."""
    module = model.get_submodule(name)
    if type(module) is nn.Linear:
        parent_name, _, child = name.rpartition(".")
        module = FastLinear(module)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
    return module


def _set_param(model: nn.Module, name: str, value: nn.Parameter) -> None:
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    module._parameters[pname] = value
