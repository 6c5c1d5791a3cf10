"""`shardlm verify DIR` and the check every command runs before it uses a checkpoint.

Per-rank files are checked against shardlm.json (its layout against config.json, every rank
folder and file inside the checkpoint, each file's size and sha256 as recorded), each safetensors
header against its file (offsets in bounds, tiling the data without overlap, dtype x shape), and
every rank's index against what that rank of the recorded layout must load (each tensor slice
present, exactly the slice the loader asks for, stored with that shape and a float dtype). A Hugging
Face folder is checked the same way against config.json and, when its index records them (convert,
consolidate), the checksums; a folder with none says so and its float data is scanned for NaN/Inf.
How much data is read is the mode's business (integrity.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shardlm.checkpoint.contain import check_folder_entries, inside
from shardlm.checkpoint.headers import (INDEX_NAME, CheckpointError, SafetensorsError, SafetensorsHeader, open_checked,
                                        weight_files)
from shardlm.checkpoint.integrity import DEFAULT_VERIFY, VERIFY_MODES, check_contents
from shardlm.checkpoint.sharded import INFO_NAME, is_sharded, looks_interrupted, rank_folder, read_info
from shardlm.models.args import ModelConfigError, read_config
from shardlm.models.registry import args_for_config

MAX_SHOWN = 5


@dataclass
class Report:
    """Problems found (empty when the checkpoint is sound) and what was checked."""

    folder: str
    kind: str = ""
    problems: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    tensors: int = 0
    checked: str = ""
    """What was compared, in words (e.g. "sha256 of 4 files match what was recorded")."""
    content: dict = field(default_factory=dict)
    """Files whose contents are checked: path -> recorded sha256, or None when none was recorded."""

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return not self.problems


def check_files(folder: Path, recorded: dict, rep: Report, named_by: str) -> dict[str, SafetensorsHeader]:
    """Containment, size and header of every recorded file; returns the opened safetensors headers.

    Files that pass are queued in `rep.content` with their recorded sha256 for the content check.
    """
    opened = {}
    for fname, rec in recorded.items():
        try:
            path = inside(folder, fname, named_by)
        except CheckpointError as e:
            rep.problems.append(str(e))
            continue
        if not path.is_file():
            rep.problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        rep.files += 1
        rep.bytes += size
        want = rec.get("bytes") if isinstance(rec, dict) else None
        if size != want:
            rep.problems.append(f"{path} is {size} bytes but {want} were written (truncated or replaced)")
            continue
        if fname.endswith(".safetensors"):
            try:
                opened[fname] = SafetensorsHeader(path)
            except SafetensorsError as e:
                rep.problems.append(str(e))
                continue
        rep.content[path] = rec.get("sha256")
    return opened


def verify(folder: str | Path, checksums: bool = True, mode: str | None = None) -> Report:
    """Check a per-rank or Hugging Face checkpoint; the report lists every problem found.

    `mode` is one of integrity.VERIFY_MODES; without it, "full" (or "headers" when not `checksums`).
    """
    mode = mode or ("full" if checksums else "headers")
    if mode not in VERIFY_MODES:
        raise CheckpointError(f"--verify {mode} is not a mode; use one of {', '.join(VERIFY_MODES)}")
    folder = Path(folder)
    rep = Report(str(folder))
    if not folder.is_dir():
        rep.problems.append(f"{folder} is not a folder")
        return rep
    try:
        check_folder_entries(folder)
        family, args = args_for_config(read_config(folder))
    except (CheckpointError, ModelConfigError, OSError) as e:
        rep.problems.append(str(e))
        return rep
    if is_sharded(folder):
        _sharded_problems(folder, family, args, rep)
    elif looks_interrupted(folder):
        rep.problems.append(f"{folder} has rank files but no {INFO_NAME}: an interrupted write; rerun it with --overwrite")
        return rep
    else:
        _hf_problems(folder, family, args, rep)
    _content_problems(rep, mode)
    return rep


def _sharded_problems(folder: Path, family, args, rep: Report) -> None:
    # imported here: judging rank slices builds meta models (torch); a Hugging Face folder needs none of it
    from shardlm.checkpoint.layout import layout_problems, rank_problems

    try:
        info = read_info(folder)
    except CheckpointError as e:
        rep.problems.append(str(e))
        return
    rep.kind = f"per-rank files, {info.describe()}, {len(info.ranks)} ranks"
    problems = layout_problems(folder, info, args)
    if problems:  # the ranks' files cannot be judged against a layout that is itself wrong
        rep.problems.extend(problems)
        return
    for rank, rec in enumerate(info.ranks):
        try:
            rank_dir = rank_folder(folder, rec, rank)
        except CheckpointError as e:
            rep.problems.append(str(e))
            continue
        files = rec.get("files")
        if not isinstance(files, dict):
            rep.problems.append(f"{folder / INFO_NAME}: rank {rank} records no 'files'; rewrite it with `shardlm shard`")
            continue
        handles = check_files(rank_dir, files, rep, f"{folder / INFO_NAME} (rank {rank}'s files)")
        try:
            rank_problems(rank_dir, rec, info, family, args, handles, rep)
        finally:
            for h in handles.values():
                h.close()


def _hf_problems(folder: Path, family, args, rep: Report) -> None:
    from shardlm.checkpoint.check import check_checkpoint

    rep.kind = "Hugging Face checkpoint"
    try:
        files = weight_files(folder)
        recorded = _recorded_checksums(folder)
    except CheckpointError as e:
        rep.problems.append(str(e))
        return
    recorded = {k: v for k, v in recorded.items() if k != INDEX_NAME}
    if recorded:
        for h in check_files(folder, recorded, rep, f"the index {folder / INDEX_NAME} (metadata.shardlm_files)").values():
            h.close()
    _header_problems(folder, files, recorded, rep)
    if rep.problems:
        return
    try:
        check_checkpoint(folder, family, args)
    except CheckpointError as e:
        rep.problems.append(str(e))


def _recorded_checksums(folder: Path) -> dict:
    """metadata.shardlm_files of the folder's index (what convert and consolidate record), else {}."""
    index = folder / INDEX_NAME
    if not index.is_file():
        return {}
    try:
        recorded = json.loads(index.read_text())["metadata"].get("shardlm_files", {})
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{index}: metadata.shardlm_files is not an object; rewrite it with `shardlm convert`")
    return recorded


def _header_problems(folder: Path, files: dict[str, Path], recorded: dict, rep: Report) -> None:
    """Every data file the checkpoint names opens with a valid header holding the tensors named in it."""
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        try:
            handle = open_checked(path)
        except CheckpointError as e:
            rep.problems.append(str(e))
            continue
        lacking = [n for n in names if n not in handle.header]
        rep.tensors += len(handle.header)
        handle.close()
        if lacking:
            rep.problems.append(f"{path} does not hold tensor {lacking[0]!r} although the index says it does"
                                + (f" (nor {len(lacking) - 1} more)" if len(lacking) > 1 else ""))
        if path.name not in recorded:
            rep.files += 1
            rep.bytes += path.stat().st_size
            rep.content[path] = None


def _content_problems(rep: Report, mode: str) -> None:
    """Hash and scan the queued files as `mode` asks, and say in words what was compared."""
    recorded = sum(v is not None for v in rep.content.values())
    if mode in ("headers", "none") or not rep.content:
        rep.checked = "headers, sizes and layout checked; file contents not read"
        return
    if rep.problems:
        rep.checked = "file contents not read: the problems above come first"
        return
    problems, hashed, skipped = check_contents(rep.content, mode)
    rep.problems.extend(problems)
    reused = f" ({skipped} unchanged since verified on this machine, {hashed} read now)" if skipped else ""
    if recorded:
        rep.checked = f"sha256 of {recorded} files match what was recorded, no NaN/Inf{reused}"
    else:
        rep.checked = ("no checksums recorded: there is nothing to compare the data against; headers checked fully "
                       f"and the float data of {len(rep.content)} files scanned for NaN/Inf{reused}")


def check_before_use(folder: str | Path, mode: str = DEFAULT_VERIFY) -> None:
    """Refuse (CheckpointError) a checkpoint that fails `verify` in `mode`, before anything uses it.

    Every read path calls this once, before a rank starts or an output is written.
    """
    if mode == "none":
        return
    rep = verify(folder, mode=mode)
    if rep.ok:
        return
    more = f" (and {len(rep.problems) - MAX_SHOWN} more)" if len(rep.problems) > MAX_SHOWN else ""
    raise CheckpointError(f"{folder} is refused before use ({rep.kind or 'checkpoint'}): "
                          + "; ".join(rep.problems[:MAX_SHOWN]) + more
                          + f". `shardlm verify {folder}` lists every problem")
