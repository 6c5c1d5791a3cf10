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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        text = {"encoding": "utf-8", "newline": "\n"} if "b" not in mode else {}
        with os.fdopen(fd, mode, **text) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, perms)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
