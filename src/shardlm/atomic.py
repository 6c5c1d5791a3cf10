"""Atomic file writes: a temporary file beside the target, fsynced, renamed over it, folder fsynced.

A crash or an error leaves either the old file or the new one, never a mix, and no temporary file.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


@contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file for writing (`mode` "w" or "wb"); on a clean exit it replaces `path`.

    The new file keeps the permissions of the file it replaces, or gets 0644 (mkstemp's 0600 would
    hide manifests and results from other users). OSError such as a missing folder propagates.
    """
    path = Path(path)
    perms = path.stat().st_mode & 0o777 if path.is_file() else 0o644
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # name the file the caller asked for, not the temporary one
        raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        text = {"encoding": "utf-8", "newline": "\n"} if "b" not in mode else {}
        with os.fdopen(fd, mode, **text) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, perms)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno and not e.filename:  # a failed write names no file: name the target
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable. POSIX only: other systems cannot open a folder for fsync."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Whole folders: build beside the target, commit with one rename.

TMP_FOLDER_MARK = ".shardlm-tmp-"
"""Part of the name of a folder being built: `.NAME.shardlm-tmp-PID-XXXX` beside NAME."""
OLD_FOLDER_MARK = ".shardlm-old-"
"""Part of the name an old folder briefly has where rename-exchange is unavailable."""
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2(2); False where the call or the flag is unsupported (then the caller falls back)."""
    import ctypes
    import errno

    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if os.name == "posix" else None
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def new_sibling_folder(target: Path) -> tuple[Path, int]:
    """Create `.NAME.shardlm-tmp-PID-XXXX` beside `target` (mode 0755) and lock it.

    Returns the folder and the descriptor holding its lock (an exclusive flock, released by the
    kernel when the process dies, which is how `sweep_siblings` tells a killed run's folder from a
    live one's). Close the descriptor with `os.close` once the folder is committed or removed.
    """
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{TMP_FOLDER_MARK}{os.getpid()}-", dir=target.parent))
    os.chmod(tmp, 0o755)
    fd = os.open(tmp, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return tmp, fd


def _abandoned(path: Path) -> bool:
    """True when no live process holds `path`'s lock (the run that built it was killed or is done)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def sweep_siblings(target: Path) -> list[Path]:
    """Remove what killed runs left beside `target`; returns what was removed.

    Unlocked build folders are deleted. An old folder set aside by a run killed between its two
    renames (only where rename-exchange is unavailable) is put back when `target` is missing.
    """
    import shutil

    removed = []
    if not target.parent.is_dir():
        return removed
    import glob

    for p in sorted(target.parent.glob(f".{glob.escape(target.name)}.shardlm-*")):
        if not p.is_dir() or p.is_symlink() or not _abandoned(p):
            continue
        if OLD_FOLDER_MARK in p.name and not target.exists():
            os.rename(p, target)
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, deepest first, then the folder itself."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def commit_folder(tmp: Path, target: Path) -> Path | None:
    """Put the finished folder `tmp` at `target` in one step; returns where the old `target` went, if any.

    A new target appears with rename-noreplace (a folder created meanwhile is not clobbered); an
    existing one is swapped with rename-exchange, so `target` is never missing. Where the system
    lacks those, two plain renames (the old folder waits at `.NAME.shardlm-old-PID`, which
    `sweep_siblings` puts back if the process dies between them). The caller deletes the old folder.
    """
    fsync_tree(tmp)
    if not target.exists():
        if not _renameat2(tmp, target, _RENAME_NOREPLACE):
            if target.exists():
                raise FileExistsError(17, "the output appeared while it was being written", str(target))
            os.rename(tmp, target)
        _fsync_dir(target.parent)
        return None
    if _renameat2(tmp, target, _RENAME_EXCHANGE):
        _fsync_dir(target.parent)
        return tmp  # the old folder now lives under the temporary name
    import fcntl

    old = target.with_name(f".{target.name}{OLD_FOLDER_MARK}{os.getpid()}")
    fd = os.open(target, os.O_RDONLY)  # locked while set aside, so no sweep puts it back under us
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(target, old)
        os.rename(tmp, target)
        _fsync_dir(target.parent)
    finally:
        os.close(fd)
    return old
