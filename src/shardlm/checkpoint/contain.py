"""Containment: every file a checkpoint names must lie inside the checkpoint's folder.

A checkpoint is data someone else wrote. Its index (`weight_map`), its shardlm.json (rank folders,
file lists) and its folder entries (config.json, tokenizer files, symlinks) name files; `inside`
is the one rule every reader applies before it opens any of them: a relative name, no `..`, and a
real path (symlinks followed) under the folder's real path. An absolute path, `../..` or a symlink
to `/etc/passwd` is refused by name, so no command reads, and no writer copies, a file from outside.

One exception, on purpose: a Hugging Face hub cache snapshot (`.../snapshots/REV/`) holds symlinks
into its repository's `blobs/` folder; those are followed when they stay inside that `blobs/`.
Refusing them would refuse every model downloaded with the hub's own tools.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from shardlm.checkpoint.headers import CheckpointError


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _hub_blobs(folder: Path) -> str | None:
    """The real path of the hub cache's `blobs/` for a snapshot folder, else None."""
    real = Path(os.path.realpath(folder))
    if real.parent.name != "snapshots":
        return None
    blobs = real.parent.parent / "blobs"
    return os.path.realpath(blobs) if blobs.is_dir() else None


def inside(folder: str | Path, name: str, named_by: str) -> Path:
    """`folder / name`, or CheckpointError when that file would lie outside `folder`.

    `name` is what the checkpoint wrote (an index entry, a shardlm.json field, a folder entry's
    name); `named_by` says where it came from, for the message (e.g. "the index X (tensor 'w')").
    Nothing is opened: the path is checked as text, then resolved (symlinks followed) and compared.
    """
    folder = Path(folder)
    fix = (f"a checkpoint names its files relative to its own folder; fix {named_by} or put the file inside "
           f"{folder}")
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{named_by} names a file {name!r}, which is not a file name; {fix}")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or os.path.isabs(name):
        raise CheckpointError(f"{named_by} names {name!r}, an absolute path outside {folder}; refused before "
                              f"opening it: {fix}")
    if ".." in parts:
        raise CheckpointError(f"{named_by} names {name!r}, which climbs out of {folder} with '..'; refused before "
                              f"opening it: {fix}")
    path = folder / name
    root, real = os.path.realpath(folder), os.path.realpath(path)
    if not _under(real, root):
        blobs = _hub_blobs(folder)
        if blobs is None or not _under(real, blobs):
            raise CheckpointError(f"{path} (named by {named_by}) is a symlink to {real}, outside {folder}; refused "
                                  f"before opening it: {fix}")
    return path


def check_folder_entries(folder: str | Path) -> None:
    """Refuse a checkpoint folder any of whose top-level entries is a symlink leading outside it.

    Every top-level file may be read (config.json, tokenizer) or copied into an output (shard,
    convert), so each one is held to `inside`; rank folders are checked by the per-rank reader.
    """
    folder = Path(folder)
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink():
            inside(folder, entry.name, f"the folder entry {entry}")
