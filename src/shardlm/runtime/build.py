"""Build one rank's model from its RankSpec, in named steps; no rank ever holds the full model.

    build_on_meta -> keep_stage -> apply_tensor_parallel -> plan_offload -> load_own_slices
    (quantize_weight as each weight arrives) -> finish_model -> start_streamer -> choose_kernels

Each step is a short function of what the previous ones produced; `build_rank_model` runs them and
returns a typed `RankModel`. Everything decided about the layout (stage, tp coordinate, streamed
layers, tier, quantization, dtype) comes from the RankSpec, made by the driver from the Plan; the
kernels are chosen here once and installed on the model from outside.

Quantization happens inside the load, one weight at a time as it is read (`quantize_weight`), so
the float model is never held; a streamed layer is written out to its tier as soon as its last
tensor is in, so the rank never holds more than its budget plus one layer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from torch import nn

from shardlm.checkpoint.headers import CheckpointError
from shardlm.checkpoint.quantized import read_quantized
from shardlm.checkpoint.reads import param_reads
from shardlm.checkpoint.source import open_source
from shardlm.kernels import choose_mode, extension, install_linears
from shardlm.kernels.build import units_of
from shardlm.kernels.fused import install_fused
from shardlm.kernels.prefill import install_prefill
from shardlm.kernels.linear import fast_linear
from shardlm.models.registry import Family
from shardlm.models.source import ModelSource
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.styles import Rowwise, RowwiseHeads, ShardCoord, param_slices, style_for
from shardlm.parallel.tensor import RowParallelLinear, parallelize
from shardlm.plan.plan import RankSpec
from shardlm.quant import Int8Weight, quantize_embedding, quantize_linear
from shardlm.quant_spec import QuantizationError, check_kind, is_quantizable
from shardlm.runtime.cuda_graph import GraphDecoders
from shardlm.runtime.gpu_blocks import install_gemv_blocks
from shardlm.runtime.projections import join_projections
from shardlm.runtime.offload import LayerStreamer, OffloadError, OffloadStore, trim_heap
from shardlm.runtime.rank_model import KernelChoice, LoadStats, RankModel
from shardlm.settings import Settings

log = logging.getLogger(__name__)


def build_rank_model(spec: RankSpec, source: ModelSource, ctx: ParallelContext, settings: Settings | None = None,
                     device: str | torch.device = "cpu", offload_io: str = "mmap") -> RankModel:
    """This rank's part of the model, with weights read from `source` (only its own slices).

    `source` is an ordinary checkpoint (the rank slices what it owns) or per-rank files written by
    `shardlm shard` (the rank opens only its own). `device` is this rank's torch device ("cpu",
    "cuda:i"). `offload_io` is how streamed layers come back on a CPU rank ("mmap" or "read").
    """
    t0, rss = time.perf_counter(), psutil.Process().memory_info().rss
    settings = settings or Settings()
    device = torch.device(device)
    dtype = getattr(torch, spec.dtype)
    quant = rank_quantization(spec, source, device)
    coord = ShardCoord.for_model(source.args, spec.tp_rank, spec.tp)
    model = build_on_meta(source.family, source.args)
    keep_stage(model, spec)
    apply_tensor_parallel(model, source.family, coord, ctx)
    target = plan_offload(model, spec, device, settings)
    try:
        extents, vocab = load_own_slices(model, source, spec, coord, ctx, dtype, device, quant, target)
        mapped = map_vocab(model, target, vocab, dtype)
    except BaseException:
        target.close()  # no scratch file outlives a failed load
        raise
    finish_model(model, coord, device)
    quantize_vocab(model, spec, dtype)
    mark_exact_sums(model, source.family)
    streamer = start_streamer(model, target, extents, vocab, device, spec, settings, offload_io)
    kernels = choose_kernels(model, spec, device, dtype, settings, streamer is not None, mapped,
                             frozenset(target.streamed))
    graphs = GraphDecoders(model, kernels.compiled) if kernels.cuda_graphs else None
    rank = RankModel(model, spec, source.args, device, dtype, coord.local_kv_heads(), kernels, streamer,
                     tuple(sorted(target.streamed)), mapped, graphs,
                     LoadStats(time.perf_counter() - t0, rss), compiled_ops(kernels, settings))
    log.info("built layers %d-%d in %.2f s: %.1f MiB resident, %d streamed, kernels %s", spec.layers[0],
             spec.layers[1] - 1, rank.stats.load_s, rank.resident_bytes() / 2**20, len(rank.streamed),
             kernels.describe())
    return rank


def wrap_module(module: nn.Module, settings: Settings | None = None) -> RankModel:
    """A RankModel around a whole single-device model already in memory (calibration, tests): the same
    kernel choice as a built rank, without loading anything."""
    args = module.args
    dtype = next(module.parameters()).dtype
    spec = RankSpec.single(args.n_layers, str(dtype).removeprefix("torch."))
    device = next(module.parameters()).device
    module.eval().requires_grad_(False)
    settings = settings or Settings()
    kernels = choose_kernels(module, spec, device, dtype, settings, False, frozenset())
    return RankModel(module, spec, args, device, dtype, args.n_kv_heads, kernels, ops=compiled_ops(kernels, settings))


def rank_quantization(spec: RankSpec, source: ModelSource, device: torch.device) -> str | None:
    """The quantization this rank loads: the checkpoint's own when it stores quantized weights (a
    different one asked for is refused), else the spec's; checked against the device."""
    asked = None if spec.quantization in (None, "none") else spec.quantization
    stored = source.quantization
    if stored and asked and asked != stored:
        raise QuantizationError(f"{source.folder} holds {stored} weights (quantization_config in config.json); "
                                f"--quantization {asked} cannot change them: drop the flag, or give the float "
                                "checkpoint")
    quant = stored or asked
    check_kind(quant, device.type)
    if device.type == "cuda" and quant == "int4" and (capability := torch.cuda.get_device_capability(device)) < (8, 0):
        raise QuantizationError(f"int4 weights need a GPU of compute capability 8.0 or later (the CUDA int4 kernel); "
                                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}; "
                                "use --quantization int8")
    return quant


def build_on_meta(family: Family, args) -> nn.Module:
    """The whole single-device model on the meta device (no memory)."""
    with torch.device("meta"):
        return family.model_class(args)


def keep_stage(model: nn.Module, spec: RankSpec) -> None:
    """Drop every layer outside this rank's pipeline stage (and the embedding / head it does not hold)."""
    if spec.pp > 1:
        model.keep_stage(spec.layers[0], spec.layers[1], spec.first_stage, spec.last_stage)


def apply_tensor_parallel(model: nn.Module, family: Family, coord: ShardCoord, ctx: ParallelContext) -> None:
    """Swap the modules the family's TP plan names for this rank's tensor-parallel slices (still on meta)."""
    parallelize(model, family.tp_plan, coord, ctx)


@dataclass
class OffloadTarget:
    """Where this rank's offloaded weights go while it loads: the tier's store and what goes there."""

    store: object | None = None
    """OffloadStore (disk tier, CPU ranks) or PinnedStore (host RAM, GPU ranks)."""
    streamed: set[int] = field(default_factory=set)
    """Decoder layers written to the store once loaded."""
    vocab: set[str] = field(default_factory=set)
    """Embedding / head parameters written to the store and used in place from it."""

    def close(self) -> None:
        """Remove the store's file (after a failed load)."""
        if self.store is not None:
            self.store.close()


def plan_offload(model: nn.Module, spec: RankSpec, device: torch.device, settings: Settings) -> OffloadTarget:
    """The store and the layers / vocabulary tensors that go to it, as the RankSpec says."""
    off = spec.offload
    if off.tier == "none":
        return OffloadTarget()
    if (off.tier == "disk") != (device.type == "cpu"):
        raise OffloadError(f"offload tier {off.tier} cannot serve a {device.type} rank: CPU ranks stream from disk "
                           "(offload.tier: disk), GPU ranks from host RAM (offload.tier: cpu)")
    layers = sorted(int(k) for k in model.model.layers.keys())
    if not 0 <= off.layers <= len(layers):
        raise OffloadError(f"offload.layers asks to stream {off.layers} layers but this stage has {len(layers)}; "
                           f"give 0 to {len(layers)}")
    if off.vocab and spec.embedding != "float":
        raise OffloadError(f"the plan streams stage {spec.stage}'s vocabulary from disk (offload.vocab) and holds the "
                           f"embedding as {spec.embedding} codes (embedding: {spec.embedding}); only a float embedding "
                           "streams: set embedding: float, or offload.vocab false for that stage")
    streamed = set(layers[len(layers) - off.layers:])
    vocab = _vocab_names(model, spec) if off.vocab else set()
    if device.type == "cuda":
        from shardlm.runtime.offload.device import PinnedStore
        return OffloadTarget(PinnedStore() if streamed else None, streamed, set())
    return OffloadTarget(OffloadStore(Path(off.dir) if off.dir else settings.offload_dir, spec.rank), streamed, vocab)


def _vocab_names(model: nn.Module, spec: RankSpec) -> set[str]:
    """The float vocabulary parameters a stage can use in place: its embedding, and a head that is a
    separate float tensor (a tied head held as a copy, or an untied one left unquantized)."""
    names = {"model.embed_tokens.weight"} if model.model.embed_tokens is not None else set()
    head_alone = model.lm_head is not None and "lm_head.weight" not in model.tied_weight_names()
    if head_alone and (model.args.tie_embeddings or spec.quantization in (None, "none")):
        names.add("lm_head.weight")
    return names


def quantize_weight(model: nn.Module, module_name: str, quant: str, ctx: ParallelContext) -> None:
    """Quantize the just-loaded weight of linear `module_name` into its kernel weight (the float copy is
    dropped); a row-parallel slice reduces its statistics over the TP group."""
    module = fast_linear(model, module_name)
    quantize_linear(module, quant, ctx if isinstance(module, RowParallelLinear) else None)


def load_own_slices(model: nn.Module, source: ModelSource, spec: RankSpec, coord: ShardCoord, ctx: ParallelContext,
                    dtype: torch.dtype, device: torch.device, quant: str | None,
                    target: OffloadTarget) -> tuple[dict, dict[str, tuple[int, int]]]:
    """Read every parameter this rank owns, quantizing linear weights as they arrive (or reading them
    quantized from a quantized checkpoint) and writing each streamed layer to the store once its last
    tensor is in. Returns ({layer module: its extent}, {vocab parameter: (offset, bytes) in the store})."""
    family, args = source.family, source.args
    # a tied LM head stays in `dtype` whether or not this rank also holds the embedding (a last
    # pipeline stage reads it as a copy): the same rule on every layout keeps tokens layout-free
    tied = {"lm_head.weight"} if args.tie_embeddings else set()
    extents: dict[nn.Module, object] = {}
    vocab: dict[str, tuple[int, int]] = {}
    current: int | None = None

    def finish(i: int | None) -> None:
        if i is not None and i in target.streamed:
            layer = model.model.layers[str(i)]
            extents[layer] = target.store.add(layer)

    with open_source(source.folder, spec.rank) as src:
        for name, read in param_reads(model, family, coord, src.shape):
            layer_id = int(name.split(".")[2]) if name.startswith("model.layers.") else None
            if layer_id != current:
                finish(current)
                current = layer_id
            module_name, _, kind = name.rpartition(".")
            quantized_here = quant and kind == "weight" and is_quantizable(module_name) and name not in tied
            if source.quantization and quantized_here:
                _read_prequantized(model, module_name, src, read, family, coord, quant, device)
                continue
            param = model.get_parameter(name)
            if read.local_shape != tuple(param.shape):
                raise CheckpointError(
                    f"tensor {read.name!r} in {src.files[read.name]} has shape {list(read.shape)}, which does not "
                    f"match config.json (this rank expects a {list(param.shape)} slice of it); the config and the "
                    "weights come from different models")
            if name in target.vocab:  # straight to the file, a block of rows at a time
                vocab[name] = target.store.add_tensor(_row_blocks(src, read, device, dtype))
                continue
            _set(model, name, nn.Parameter(src.read(read.name, read.slices).to(device=device, dtype=dtype),
                                           requires_grad=False))
            if quantized_here:
                quantize_weight(model, module_name, quant, ctx)
        finish(current)
    return extents, vocab


def _read_prequantized(model: nn.Module, module_name: str, src, read, family: Family, coord: ShardCoord, quant: str,
                       device: torch.device) -> None:
    """Load a linear weight stored quantized: this rank's rows and columns of its codes and scales."""
    module = fast_linear(model, module_name)
    in_total = getattr(module, "in_total", module.weight.shape[1])
    rows, cols = param_slices(read.name, (read.shape[0], in_total), family.tp_plan, coord)
    module.kernel_weight = read_quantized(src, read.name, quant, rows, cols, in_total, device)
    module.weight = None


def _row_blocks(src, read, device, dtype, block_bytes: int = 8 * 2**20):
    """Yield `read`'s slice of its tensor as consecutive blocks of rows of about `block_bytes`."""
    rows, rest = read.slices[0], read.slices[1:]
    per_row = max(1, torch.empty(0, dtype=dtype).element_size() * int(torch.Size(read.local_shape[1:]).numel()))
    step = max(1, block_bytes // per_row)
    for a in range(rows.start, rows.stop, step):
        yield src.read(read.name, (slice(a, min(rows.stop, a + step)), *rest)).to(device=device, dtype=dtype)


def _set(model: nn.Module, name: str, value: nn.Parameter) -> None:
    """Set parameter `name` of `model` (replacing its meta placeholder)."""
    module_name, _, pname = name.rpartition(".")
    setattr(model.get_submodule(module_name) if module_name else model, pname, value)


def map_vocab(model: nn.Module, target: OffloadTarget, vocab: dict[str, tuple[int, int]],
              dtype: torch.dtype) -> frozenset[int]:
    """Make the vocabulary parameters written to the store views of its memory mapping; returns their ids."""
    if not vocab:
        return frozenset()
    flat = target.store.mapped()
    ids = set()
    for name, (offset, nbytes) in vocab.items():
        meta = model.get_parameter(name)
        p = nn.Parameter(flat[offset:offset + nbytes].view(dtype).view(meta.shape), requires_grad=False)
        _set(model, name, p)
        ids.add(id(p))
    return frozenset(ids)


def finish_model(model: nn.Module, coord: ShardCoord, device: torch.device) -> None:
    """Tie shared weights, rebuild the non-persistent buffers, set the GQA map of an uneven TP split,
    freeze the model and hand freed heap pages back."""
    for target, source in model.tied_weight_names().items():
        _set(model, target, model.get_parameter(source))
    model.reset_buffers(device)
    if coord.tp > 1:
        for module in model.modules():
            if hasattr(module, "set_kv_map"):
                module.set_kv_map(coord.heads.kv_map(coord.rank), device)
    model.eval().requires_grad_(False)
    trim_heap()  # what reading, converting and quantizing freed


def quantize_vocab(model: nn.Module, spec: RankSpec, dtype: torch.dtype) -> None:
    """Embedding "int8" (`--quantize-embedding`): the embedding becomes int8 rows with a scale each, and an LM head
    tied to it multiplies by those same codes through the int8 kernel (the float table is dropped). A last stage
    without the embedding quantizes its copy of the tied head the same way, row by row, so every layout holds the
    same codes. An untied head is left as `--quantization` made it."""
    if spec.embedding == "float":
        return
    codes = None
    if model.model.embed_tokens is not None:
        model.model.embed_tokens = quantize_embedding(model.model.embed_tokens, dtype)
        codes = model.model.embed_tokens.kernel_weight
    if model.lm_head is not None and model.args.tie_embeddings:
        head = fast_linear(model, "lm_head")
        if codes is None:
            quantize_linear(head, "int8")
        else:
            head.kernel_weight, head.weight = codes, None
    trim_heap()  # the float table


def mark_exact_sums(model: nn.Module, family: Family) -> None:
    """Flag the quantized weights whose rows tensor parallelism splits by input column (the family's row-wise
    styles: o_proj, down_proj), at any tp: their kernels sum in double, so a tp 1 rank rounds what tp N ranks'
    float64 partial sums add up to, and quantized tokens do not depend on the layout (shardlm.quant)."""
    for name, module in model.named_modules():
        kw = getattr(module, "kernel_weight", None)
        if hasattr(kw, "exact") and isinstance(style_for(name, family.tp_plan), (Rowwise, RowwiseHeads)):
            kw.exact = True


def order_codes(model: nn.Module, streamed: frozenset[int] = frozenset()) -> None:
    """Put the codes of the int8 weights a CPU rank holds in memory in the order our kernels read fastest (called
    once they are the rank's kernels: torch's int8 kernel would reorder them back every product): interleaved for
    the exact sums (csrc/qexact.h), paired for the float ones (csrc/qpairs.h); the numbers are the same. The
    `streamed` layers come back from the store as written and keep their natural codes."""
    ordered: set[int] = set()  # a tied head and embedding share one Int8Weight
    for name, module in model.named_modules():
        kw = getattr(module, "kernel_weight", None)
        if isinstance(kw, Int8Weight) and kw.q.device.type == "cpu" and _layer_of(name) not in streamed \
                and id(kw) not in ordered and not (kw.interleaved or kw.paired):
            ordered.add(id(kw))
            kw.interleave() if kw.exact else kw.pair()


def _layer_of(name: str) -> int | None:
    """The decoder layer a module name sits in ("model.layers.3.mlp.down_proj" -> 3), None outside the layers."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts[:-1] else None


def start_streamer(model: nn.Module, target: OffloadTarget, extents: dict, vocab: dict, device: torch.device,
                   spec: RankSpec, settings: Settings, offload_io: str):
    """The hooks that bring streamed layers in ahead of use (None when nothing streams)."""
    if target.store is None or not (extents or vocab):
        return None
    order = [m for m in model.model.layers.values() if m in extents]
    if device.type == "cuda":
        from shardlm.runtime.offload.device import DeviceStreamer
        return DeviceStreamer(extents, order, device, spec.offload.prefetch)
    head = fast_linear(model, "lm_head") if model.lm_head is not None else None
    return LayerStreamer(target.store, extents, order, spec.offload.prefetch, offload_io, settings.offload_uncached,
                         vocab, model.model.embed_tokens, head)


def compiled_ops(kernels: KernelChoice, settings: Settings):
    """The compiled CPU kernels a rank chose (its linear mode "gemv"), or None."""
    return extension(settings.kernel_dir) if kernels.linear == "gemv" else None


def choose_kernels(model: nn.Module, spec: RankSpec, device: torch.device, dtype: torch.dtype, settings: Settings,
                   streaming: bool, mapped: frozenset[int], streamed: frozenset[int] = frozenset()) -> KernelChoice:
    """Pick this rank's kernels once and install them on the model: CPU linear kernels (with our own, the int8
    codes of the layers not `streamed` in their order, order_codes) and the fused decode step; on a GPU, joined
    q/k/v and gate/up products (nothing streamed) and CUDA-graph decode on a one-GPU rank."""
    if device.type == "cuda":
        graphs = settings.cuda_graphs and not streaming and spec.tp == 1 and spec.pp == 1
        joined = join_projections(model) if settings.cuda_join and not streaming else 0
        if joined:
            torch.cuda.empty_cache()  # the separate weights the joined tensors replaced
        gemv = install_gemv_blocks(model) if graphs and joined and settings.cuda_gemv else 0
        return KernelChoice("cuda", 0, graphs, graphs and settings.cuda_compile, joined, graphs and settings.cuda_ahead,
                            not (graphs and settings.batch_invariant), gemv_layers=gemv)
    mode, ext = choose_mode(settings.kernels, settings.kernel_dir)
    if mode == "gemv":
        order_codes(model, streamed)
    install_linears(model, mode, ext, keep=mapped)
    units = units_of(ext) if mode == "gemv" else ""
    if not (settings.fused and mode == "gemv"):
        return KernelChoice(mode, 0, False, units=units)
    fused = install_fused(model, ext, dtype, fixed=not streaming)
    return KernelChoice(mode, fused, False, prefill_layers=install_prefill(model, ext, dtype), units=units)
