"""All-or-nothing output folders for shard, reshard, consolidate and convert.

A write command builds its whole output (weights, indexes, shardlm.json, config.json, tokenizer,
chat template, generation config) in a locked temporary folder beside the target,
`.NAME.shardlm-tmp-PID-XXXX`, and renames it into place only when everything is written and
fsynced (atomic.commit_folder). So a refusal, a full disk, Ctrl-C or SIGKILL leaves no output
folder at all, or the old one untouched; a rerun needs no --overwrite; and what a killed run left
beside the target is swept by the next run that writes there (atomic.sweep_siblings).

With --overwrite, the files of the old folder that are not part of a checkpoint (notes, a README)
are carried into the new one (hard links where possible), so replacing a checkpoint keeps them.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from shardlm.atomic import OLD_FOLDER_MARK, TMP_FOLDER_MARK, commit_folder, new_sibling_folder, sweep_siblings
from shardlm.checkpoint.headers import INDEX_NAME, CheckpointError
from shardlm.checkpoint.sharded import INFO_NAME
from shardlm.checkpoint.writer import TMP_MARK


def is_checkpoint_entry(path: Path) -> bool:
    """Files and folders a shardlm writer puts in an output folder (what --overwrite replaces)."""
    n = path.name
    return (n in (INFO_NAME, INDEX_NAME) or n.endswith(".safetensors") or TMP_MARK in n
            or (path.is_dir() and n.startswith("rank-")))


def check_target(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse an output that overlaps the source, is a file, or is a non-empty folder without `overwrite`."""
    out, source = Path(out).resolve(), Path(source).resolve()
    if out == source or source in out.parents or out in source.parents:
        raise CheckpointError(f"the output folder {out} overlaps the input {source}; write to a separate folder")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file, not a folder; choose another output path")
    entries = list(out.iterdir()) if out.is_dir() else []
    if entries and not overwrite:
        raise CheckpointError(f"the output folder {out} is not empty ({len(entries)} entries); choose an empty or new "
                              "folder, or pass --overwrite to replace the checkpoint in it")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry_user_files(old: Path, new: Path) -> None:
    """Hard-link (or copy) into `new` the entries of `old` that no checkpoint writer owns and `new` lacks."""
    for entry in sorted(old.iterdir()):
        dst = new / entry.name
        if is_checkpoint_entry(entry) or dst.exists() or dst.is_symlink():
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), dst)
        elif entry.is_dir():
            shutil.copytree(entry, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(dst))


def _tree_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _os_message(e: OSError, tmp: Path, out: Path, existed: bool, written: int) -> str:
    """The error with the path it happened on (as the user knows it) and what to do."""
    path = str(e.filename) if e.filename else str(out)
    if path.startswith(str(tmp)):
        path = str(out) + path[len(str(tmp)):]
    state = f"{out} is unchanged" if existed else f"{out} was not created"
    fix = ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = (f"; {written / 1e6:.1f} MB had been written when the disk holding {out.parent} filled up: free space "
               "there (or choose another -o) and rerun")
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"; check that {out.parent} is writable, or choose another -o"
    return f"{e.strerror or e}: {path}; nothing was written ({state}){fix}"


@contextmanager
def output_folder(out: Path, source: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder to write the whole output in; on a clean exit it becomes `out`.

    On any error the temporary folder is removed and `out` is as it was; an OSError comes out as a
    CheckpointError naming the path and the fix. Stale build folders beside `out` are swept first.
    """
    out = Path(out).absolute()
    check_target(out, source, overwrite)
    missing = next((p for p in reversed([out.parent, *out.parent.parents]) if not p.exists()), None)
    existed = out.exists()
    try:
        sweep_siblings(out)
        tmp, lock = new_sibling_folder(out)
    except OSError as e:
        raise CheckpointError(_os_message(e, out, out, existed, 0)) from e
    old = None
    try:
        yield tmp
        if out.is_dir():
            _carry_user_files(out, tmp)
        old = commit_folder(tmp, out)
    except BaseException as e:
        written = _tree_bytes(tmp) if isinstance(e, OSError) else 0
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
        _remove_empty(missing, out)
        if isinstance(e, OSError):
            raise CheckpointError(_os_message(e, tmp, out, existed, written)) from e
        raise
    os.close(lock)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_empty(first_missing: Path | None, out: Path) -> None:
    """Remove the parent folders this run created for `out`, if they are still empty."""
    if first_missing is None:
        return
    p = out.parent
    while True:
        try:
            p.rmdir()
        except OSError:
            return
        if p == first_missing:
            return
        p = p.parent


def stale_siblings(out: Path) -> list[Path]:
    """Build folders beside `out` (for tests and benchmarks that count what killed runs left)."""
    out = Path(out).absolute()
    names = out.parent.glob(f".{glob.escape(out.name)}.shardlm-*")
    return sorted(p for p in names if TMP_FOLDER_MARK in p.name or OLD_FOLDER_MARK in p.name)
