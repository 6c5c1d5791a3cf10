"""`shardlm verify DIR`: headers, sizes, checksums and coverage of a checkpoint written by shardlm.

Per-rank files are checked against shardlm.json (every file present, its size and sha256 as
recorded), each safetensors header against its file (truncation, offsets), and every rank's index
against what that rank of the recorded layout must load (each tensor slice present, exactly the
slice the loader asks for, with the shape config.json implies). An HF folder written by convert
or consolidate is checked the same way against the checksums in its index.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from shardlm.checkpoint.headers import SafetensorsError
from shardlm.checkpoint.reader import SafetensorsFile
from shardlm.checkpoint.reads import needed_names, param_reads, rank_meta_model
from shardlm.checkpoint.sharded import INFO_NAME, is_sharded, looks_interrupted, read_info
from shardlm.checkpoint.headers import INDEX_NAME, CheckpointError
from shardlm.models.args import ModelConfigError, read_config
from shardlm.models.registry import args_for_config
from shardlm.parallel.stages import StageSpec
from shardlm.parallel.styles import ShardCoord

MAX_SHOWN = 8


@dataclass
class Report:
    """Problems found (empty when the checkpoint is sound) and what was checked."""

    folder: str
    kind: str = ""
    problems: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    tensors: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def _check_files(folder: Path, recorded: dict[str, dict], rep: Report, checksums: bool) -> dict[str, SafetensorsFile]:
    """Size, checksum and header of every recorded file; returns the opened safetensors headers."""
    opened = {}
    for fname, rec in recorded.items():
        path = folder / fname
        if not path.is_file():
            rep.problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        rep.files += 1
        rep.bytes += size
        if size != rec["bytes"]:
            rep.problems.append(f"{path} is {size} bytes but {rec['bytes']} were written (truncated or replaced)")
            continue
        if checksums and _sha256(path) != rec["sha256"]:
            rep.problems.append(f"{path} does not match the sha256 recorded when it was written (corrupted)")
            continue
        if fname.endswith(".safetensors"):
            try:
                opened[fname] = SafetensorsFile(path)
            except SafetensorsError as e:
                rep.problems.append(str(e))
    return opened


def _rank_problems(folder: Path, rank_rec: dict, info, family, args, rep: Report, checksums: bool) -> None:
    rank_dir = folder / rank_rec["dir"]
    files = _check_files(rank_dir, rank_rec["files"], rep, checksums)
    try:
        index = json.loads((rank_dir / INDEX_NAME).read_text())
        slices, weight_map = index["metadata"]["shardlm_slices"], index["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        rep.problems.append(f"{rank_dir / INDEX_NAME} is unreadable ({type(e).__name__}: {e})")
        return
    stage, tp_rank = rank_rec["stage"], rank_rec["tp_rank"]
    coord = ShardCoord.for_model(args, tp_rank, info.tp)
    spec = StageSpec.of(info.stage_layers, stage) if info.pp > 1 else None
    model = rank_meta_model(family, args, coord, spec)
    where = f"rank {rank_rec['rank']} ({rank_dir.name})"
    for _, ck_name in needed_names(model, family):
        if ck_name not in slices:
            rep.problems.append(f"{where} lacks tensor {ck_name!r}, which it loads")
    try:
        expected = param_reads(model, family, coord, lambda n: slices[n]["shape"] if n in slices else None)
    except (ValueError, IndexError, TypeError) as e:
        rep.problems.append(f"{where}: its slices cannot be computed from the recorded shapes ({e})")
        return
    for pname, read in expected:
        rep.tensors += 1
        if read.local_shape != tuple(model.get_parameter(pname).shape):
            rep.problems.append(f"{where}: tensor {read.name!r} has full shape {list(read.shape)}, which contradicts "
                                f"config.json")
            continue
        stored = [tuple(r) for r in slices[read.name]["slices"]]
        if stored != [(s.start, s.stop) for s in read.slices]:
            rep.problems.append(f"{where}: tensor {read.name!r} holds slice {stored} but the layout needs "
                                f"{read.ranges()}; the files do not match shardlm.json's layout")
            continue
        fname = weight_map.get(read.name)
        handle = files.get(fname)
        if handle is None:  # a file shardlm.json records but that failed its checks is reported already
            if fname not in rank_rec["files"]:
                rep.problems.append(f"{where}: the index puts tensor {read.name!r} in {fname}, a file shardlm.json "
                                    "does not record")
            continue
        if read.name not in handle.header:
            rep.problems.append(f"{rank_dir / fname} lacks tensor {read.name!r} although the index names it")
        elif handle.shape(read.name) != read.local_shape:
            rep.problems.append(f"{rank_dir / fname}: tensor {read.name!r} is stored as {list(handle.shape(read.name))}, "
                                f"not the {list(read.local_shape)} slice the index records")
    for h in files.values():
        h.close()


def verify(folder: str | Path, checksums: bool = True) -> Report:
    """Check a per-rank or HF checkpoint written by shardlm; the report lists every problem found."""
    folder = Path(folder)
    rep = Report(str(folder))
    if not folder.is_dir():
        rep.problems.append(f"{folder} is not a folder")
        return rep
    try:
        family, args = args_for_config(read_config(folder))
    except (ModelConfigError, OSError) as e:
        rep.problems.append(str(e))
        return rep
    if is_sharded(folder):
        try:
            info = read_info(folder)
        except CheckpointError as e:
            rep.problems.append(str(e))
            return rep
        rep.kind = f"per-rank files, {info.describe()}, {len(info.ranks)} ranks"
        if len(info.ranks) != info.tp * info.pp:
            rep.problems.append(f"{folder / INFO_NAME} lists {len(info.ranks)} ranks but tp {info.tp} x pp {info.pp} "
                                f"needs {info.tp * info.pp}")
        for rec in info.ranks:
            _rank_problems(folder, rec, info, family, args, rep, checksums)
        return rep
    if looks_interrupted(folder):
        rep.problems.append(f"{folder} has rank files but no {INFO_NAME}: an interrupted write; rerun it with --overwrite")
        return rep
    _hf_problems(folder, family, args, rep, checksums)
    return rep


def _hf_problems(folder: Path, family, args, rep: Report, checksums: bool) -> None:
    from shardlm.checkpoint.check import check_checkpoint

    rep.kind = "Hugging Face checkpoint"
    index = folder / INDEX_NAME
    recorded = {}
    if index.is_file():
        try:
            recorded = json.loads(index.read_text())["metadata"].get("shardlm_files", {})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            rep.problems.append(f"{index} is unreadable ({type(e).__name__}: {e})")
            return
    recorded = {k: v for k, v in recorded.items() if k != INDEX_NAME}
    if recorded:
        for h in _check_files(folder, recorded, rep, checksums).values():
            h.close()
    else:
        rep.kind += " (no checksums recorded: headers and shapes checked only)"
    if rep.problems:
        return
    try:
        check_checkpoint(folder, family, args)
    except CheckpointError as e:
        rep.problems.append(str(e))
