"""shard, reshard, consolidate, convert: stream a checkpoint into per-rank files or size-capped HF shards.

Every operation reads one tensor slice at a time from an `open_reader` source (an ordinary
checkpoint or per-rank files) and writes it with `writer.write_group`, so the model is never held
in memory. The source is checked before anything is read (verify.check_before_use, as `verify`
says) and the whole output, metadata included, is built in a temporary folder beside the target
and renamed into place at the end (output.output_folder): a refusal, a full disk or a kill leaves
no output folder, or the old one untouched.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from shardlm.checkpoint.check import check_checkpoint
from shardlm.checkpoint.contain import inside
from shardlm.checkpoint.integrity import DEFAULT_VERIFY
from shardlm.checkpoint.layout import stages_problem
from shardlm.checkpoint.output import check_target, output_folder
from shardlm.checkpoint.quantized import stored_tensors
from shardlm.checkpoint.reads import param_reads, rank_meta_model
from shardlm.checkpoint.readers import open_reader, source_identity
from shardlm.checkpoint.sharded import INFO_NAME, ShardedInfo, rank_dir_name
from shardlm.checkpoint.headers import INDEX_NAME, CheckpointError
from shardlm.checkpoint.verify import check_before_use
from shardlm.checkpoint.writer import Entry, write_group
from shardlm.models.args import read_config
from shardlm.models.registry import args_for_config, require_runnable
from shardlm.parallel.stages import StageSpec
from shardlm.parallel.styles import ShardCoord
from shardlm.plan.layout import ParallelLayout
from shardlm.quant import ACT_DTYPE
from shardlm.quant_spec import checkpoint_quantization, config_entry, is_quantizable, stored_shapes

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass
class WriteStats:
    """What one operation wrote and how long it took."""

    bytes_written: int = 0
    files: int = 0
    seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        """Throughput in MB/s (10^6 bytes)."""
        return self.bytes_written / 1e6 / max(self.seconds, 1e-9)


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _quantized_entries(reader, names: list[str], dtype: str | None, kind: str) -> list[Entry]:
    """Writer entries with every linear weight quantized; the three tensors of one weight share one
    quantization, computed when the first of them is written and dropped after the last."""
    entries: list[Entry] = []
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def part(weight: str, stored: str):
        def produce() -> torch.Tensor:
            if weight not in cache:
                full = reader.read(weight, tuple(slice(0, d) for d in reader.shape(weight)))
                cache.clear()
                cache[weight] = stored_tensors(weight, full, kind)
            return cache[weight].pop(stored)
        return produce

    for n in names:
        shape = tuple(reader.shape(n))
        module = n.removesuffix(".weight")
        if n.endswith(".weight") and len(shape) == 2 and is_quantizable(module):
            for stored, sshape in stored_shapes(n, shape, kind).items():
                sdtype = {n: torch.int8 if kind == "int8" else torch.uint8}.get(stored, ACT_DTYPE)
                entries.append(Entry(stored, sdtype, sshape, part(n, stored)))
        else:
            entries.append(Entry(n, _out_dtype(dtype, reader.dtype(n)), shape,
                                 lambda n=n: reader.read(n, tuple(slice(0, d) for d in reader.shape(n)))))
    return entries


def copy_model_files(source: Path, out: Path) -> None:
    """Copy config.json, tokenizer and other non-weight files from the source root into `out`.

    Each is held to containment first (a symlink leading out of the source is refused, not copied).
    `out` is the temporary build folder, so these files commit with the weights or not at all.
    """
    for f in sorted(Path(source).iterdir()):
        if f.name in (INFO_NAME, INDEX_NAME) or f.name.startswith("."):
            continue
        if f.suffix in WEIGHT_SUFFIXES or f.name.endswith(".index.json"):
            continue
        path = inside(source, f.name, f"the folder entry {f}")
        if path.is_file():
            shutil.copyfile(path, out / f.name)


@contextmanager
def _progress(total: int, label: str, show: bool) -> Iterator[Callable[[int], None]]:
    if not show:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _out_dtype(dtype: str | None, stored: torch.dtype) -> torch.dtype:
    if dtype is None or not stored.is_floating_point:
        return stored
    return getattr(torch, dtype)


def _rank_reads(family, args, reader, tp: int, stage_layers: tuple[tuple[int, int], ...]) -> list[tuple]:
    """(rank, stage, tp_rank, [TensorRead]) for every rank of tp x len(stage_layers) (one replica: its ranks
    numbered as the plan's ParallelLayout numbers them)."""
    pp, plans = len(stage_layers), []
    devices = ((tuple(f"0:{s * tp + t}" for t in range(tp)) for s in range(pp)),)
    layout = ParallelLayout(tp, pp, 1, tuple(stage_layers), tuple(tuple(d) for d in devices))
    for c in layout.coords():
        coord = ShardCoord.for_model(args, c.tp_rank, tp)
        spec = StageSpec.of(stage_layers, c.stage) if pp > 1 else None
        reads = [r for _, r in param_reads(rank_meta_model(family, args, coord, spec), family, coord, reader.shape)]
        plans.append((c.rank, c.stage, c.tp_rank, reads))
    return plans


def _write_ranks(reader, plans: list[tuple], out: Path, max_bytes: int, dtype: str | None, label: str,
                 progress: bool, stats: WriteStats) -> list[dict]:
    """Write every rank's files under `out`; returns shardlm.json's rank records."""
    total = sum(Entry(r.name, _out_dtype(dtype, reader.dtype(r.name)), r.local_shape, None).nbytes
                for p in plans for r in p[3])
    ranks = []
    with _progress(total, label, progress) as advance:
        for rank, stage, tp_rank, reads in plans:
            entries = [Entry(r.name, _out_dtype(dtype, reader.dtype(r.name)), r.local_shape,
                             lambda r=r: reader.read(r.name, r.slices)) for r in reads]
            meta = {"shardlm_slices": {r.name: {"shape": list(r.shape), "slices": r.ranges()} for r in reads}}
            files = write_group(out / rank_dir_name(rank), entries, max_bytes, meta, advance)
            ranks.append({"rank": rank, "stage": stage, "tp_rank": tp_rank, "dir": rank_dir_name(rank), "files": files})
            stats.bytes_written += sum(f["bytes"] for f in files.values())
            stats.files += len(files)
    return ranks


def shard(source: Path, out: Path, tp: int, stage_layers: tuple[tuple[int, int], ...], max_bytes: int,
          dtype: str | None = None, overwrite: bool = False, progress: bool = True,
          plan: dict | None = None, verify: str = DEFAULT_VERIFY) -> WriteStats:
    """Write per-rank files for tp x len(stage_layers) ranks from `source` (ordinary or per-rank files).

    `plan` (the manifest as parsed YAML) is recorded in shardlm.json beside the layout; `verify`
    is how much of `source` is checked before use (integrity.VERIFY_MODES).
    """
    source, out = Path(source), Path(out)
    check_target(out, source, overwrite)
    check_before_use(source, verify)
    cfg = read_config(source)
    if checkpoint_quantization(cfg):
        raise CheckpointError(f"{source} is a quantized checkpoint; per-rank files are written from float "
                              "checkpoints only for now: shard the float one and add --quantization when you "
                              "generate (the ranks quantize as they load, to the same values)")
    family, args = args_for_config(cfg)
    require_runnable(family, args)
    stage_layers = tuple(stage_layers) or ((0, args.n_layers),)
    wrong = stages_problem(stage_layers, args.n_layers)
    if wrong:
        raise CheckpointError(f"the plan's stages {wrong} of {source}: the manifest was planned for another model; "
                              f"plan for this one (`shardlm plan {source} ...`)")
    reader = open_reader(source)
    try:
        check_checkpoint(source, family, args, reader)
        plans = _rank_reads(family, args, reader, tp, stage_layers)
        stats, t0 = WriteStats(), time.perf_counter()
        with output_folder(out, source, overwrite) as tmp:
            copy_model_files(source, tmp)
            ranks = _write_ranks(reader, plans, tmp, max_bytes, dtype, f"sharding for tp {tp} x pp {len(stage_layers)}",
                                 progress, stats)
            info = ShardedInfo(tp, stage_layers, dtype or "as-stored",
                               {"path": str(source.resolve()), "identity": source_identity(source, reader),
                                "written": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}, ranks, plan)
            (tmp / INFO_NAME).write_text(json.dumps(info.to_json(), indent=1))
        stats.seconds = time.perf_counter() - t0
        return stats
    finally:
        reader.close()


def write_whole(source: Path, out: Path, max_bytes: int, dtype: str | None = None, overwrite: bool = False,
                progress: bool = True, label: str = "writing", quantization: str | None = None,
                verify: str = DEFAULT_VERIFY) -> WriteStats:
    """Write the whole model from `source` (ordinary or per-rank files) as size-capped HF shards + index.

    The index metadata records each file's bytes and sha256 (`shardlm_files`) for `shardlm verify`.
    With `quantization` ("int8"/"int4") the linear weights are stored quantized (checkpoint/quantized.py),
    one weight in memory at a time, and config.json records it. `verify` is how much of `source`
    is checked before use (integrity.VERIFY_MODES).
    """
    source, out = Path(source), Path(out)
    check_target(out, source, overwrite)
    check_before_use(source, verify)
    cfg = read_config(source)
    family, args = args_for_config(cfg)
    if quantization and checkpoint_quantization(cfg):
        raise CheckpointError(f"{source} is already quantized ({checkpoint_quantization(cfg)}); convert its float "
                              "original instead")
    reader = open_reader(source)
    try:
        names = sorted(reader.names(), key=_natural)
        check_checkpoint(source, family, args, reader)
        if quantization:
            entries = _quantized_entries(reader, names, dtype, quantization)
        else:
            # a quantized source's scales and zeros stay bfloat16 whatever --dtype says (the kernels' format)
            keep = lambda n: n.endswith((".weight_scale", ".weight_zero"))  # noqa: E731
            entries = [Entry(n, _out_dtype(None if keep(n) else dtype, reader.dtype(n)), reader.shape(n),
                             lambda n=n: reader.read(n, tuple(slice(0, d) for d in reader.shape(n)))) for n in names]
        stats, t0 = WriteStats(), time.perf_counter()
        with output_folder(out, source, overwrite) as tmp:
            copy_model_files(source, tmp)
            if quantization:
                (tmp / "config.json").write_text(json.dumps({**cfg, "quantization_config": config_entry(quantization)},
                                                            indent=2))
            with _progress(sum(e.nbytes for e in entries), label, progress) as advance:
                files = write_group(tmp, entries, max_bytes, None, advance, checksums_in_index=True)
        stats.bytes_written = sum(f["bytes"] for f in files.values())
        stats.files = len(files)
        stats.seconds = time.perf_counter() - t0
        return stats
    finally:
        reader.close()
