"""File contents: sha256 against what was recorded, float data free of NaN/Inf, and files already seen.

`--verify` decides how much of this a command does before it uses a checkpoint:

- `full`: hash every file and scan every float tensor, every time (one read of the whole model).
- `changed` (the default): the same, but only for files this machine has not verified in their
  current state. A file verified once is remembered in `$SHARDLM_HOME/verified.json` under its real
  path with its device, inode, size, mtime and ctime; any write to the file changes its ctime (which
  no user call can set back), so a changed file is hashed again. What is remembered is the file's
  actual sha256, so an edited checksum in shardlm.json is still compared on every start.
- `headers`: headers, sizes, layout and config only; no data read.
- `none`: no check before use (each file's header is still validated when it is opened).

Headers are checked in every mode but `none`; containment is enforced by every reader in every mode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from shardlm.checkpoint.headers import SafetensorsHeader

log = logging.getLogger(__name__)

VERIFY_MODES = ("full", "changed", "headers", "none")
"""What `--verify` accepts, from most to least work."""
DEFAULT_VERIFY = "changed"
"""What every command does unless told otherwise (see the module docstring)."""
VERIFY_HELP = ("Before use: full (sha256 + NaN scan of every file), changed (the same for files not yet verified "
               "in their current state on this machine; default), headers (no data read), none.")
SEEN_NAME = "verified.json"
SEEN_LIMIT = 20000
"""Most files remembered; the oldest are forgotten first (they are simply hashed again)."""
CHUNK = 16 * 2**20
# NaN and Inf are the floats whose exponent bits are all ones: one mask per width, no float decoding
NONFINITE = {"F16": ("uint16", 0x7C00), "BF16": ("uint16", 0x7F80), "F32": ("uint32", 0x7F800000),
             "F64": ("uint64", 0x7FF0000000000000)}
TORCH_FLOATS = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


@dataclass
class FileResult:
    """What reading one file found."""

    path: Path
    sha256: str
    nonfinite: dict[str, int]
    """Float tensors holding NaN or Inf: name -> how many values."""


def _count_nonfinite(chunk: memoryview, dtype: str) -> int:
    """NaN and Inf values in `chunk` (whole values of `dtype`: CHUNK and every tensor length are multiples).

    A sum is finite only when every value is (NaN and Inf propagate), and torch sums any float width
    at memory speed, so the exact count by exponent bits runs only when the sum says something is
    wrong (or a float16 sum overflows, which the count then clears).
    """
    import numpy as np  # imported here: the driver imports this module for its modes, never torch
    import torch

    if bool(torch.isfinite(torch.frombuffer(chunk, dtype=getattr(torch, TORCH_FLOATS[dtype])).sum())):
        return 0
    name, mask = NONFINITE[dtype]
    width = getattr(np, name)
    words = np.frombuffer(chunk, dtype=width)
    return int(np.count_nonzero((words & width(mask)) == mask))


def _scan_range(fd: int, start: int, stop: int, digest, buf: memoryview, dtype: str | None) -> int:
    """Hash bytes start..stop of `fd`; with a float `dtype`, return how many values are NaN or Inf."""
    bad, pos = 0, start
    width, mask = NONFINITE.get(dtype, (None, 0))
    while pos < stop:
        n = min(len(buf), stop - pos)
        got = 0
        while got < n:
            k = os.preadv(fd, [buf[got:n]], pos + got)
            if k == 0:
                raise OSError(f"unexpected end of file at byte {pos + got}")
            got += k
        digest.update(buf[:n])
        if width is not None:
            bad += _count_nonfinite(buf[:n], dtype)
        pos += n
    return bad


def scan_file(path: Path) -> FileResult:
    """sha256 of the whole file and, for a safetensors file, its float tensors that hold NaN or Inf.

    The header's validation (headers.py) guarantees the tensors tile the data exactly, so reading
    header then tensors in offset order reads every byte once.
    """
    digest, nonfinite = hashlib.sha256(), {}
    buf = memoryview(bytearray(CHUNK))
    if path.suffix != ".safetensors":
        fd = os.open(path, os.O_RDONLY)
        try:
            _scan_range(fd, 0, os.fstat(fd).st_size, digest, buf, None)
        finally:
            os.close(fd)
        return FileResult(path, digest.hexdigest(), {})
    head = SafetensorsHeader(path)
    try:
        _scan_range(head.fd, 0, head.data_start, digest, buf, None)
        spans = sorted((info["data_offsets"], name) for name, info in head.header.items())
        for (start, stop), name in spans:
            bad = _scan_range(head.fd, head.data_start + start, head.data_start + stop, digest, buf,
                              head.header[name]["dtype"])
            if bad:
                nonfinite[name] = bad
    finally:
        head.close()
    return FileResult(path, digest.hexdigest(), nonfinite)


def _stat_key(path: Path) -> str | None:
    """What changes whenever the file's contents can have changed (ctime: no call sets it back); None if gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class SeenFiles:
    """Files this machine verified, by real path: {"key": stat key, "sha256": actual digest}."""

    def __init__(self, path: Path | None = None):
        from shardlm.paths import home

        self.path = path or home() / SEEN_NAME
        self.entries: dict[str, dict] = {}
        self.changed = False
        try:
            doc = json.loads(self.path.read_text())
            self.entries = doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):
            self.entries = {}  # no record (or an unreadable one) only means files are hashed again

    def digest(self, path: Path) -> str | None:
        """The sha256 recorded for `path` if it is unchanged since it was verified, else None."""
        rec = self.entries.get(os.path.realpath(path))
        if not isinstance(rec, dict):
            return None
        key = _stat_key(path)
        return rec.get("sha256") if key is not None and rec.get("key") == key else None

    def remember(self, path: Path, sha256: str, key: str) -> None:
        """Record `path` as verified in the state `key` (its stat key taken before it was read)."""
        real = os.path.realpath(path)
        self.entries.pop(real, None)  # re-inserted last: dict order is age order
        self.entries[real] = {"key": key, "sha256": sha256}
        self.changed = True

    def save(self) -> None:
        """Write the record (forgetting vanished and the oldest files); a failure only costs a re-hash later."""
        if not self.changed:
            return
        from shardlm.atomic import atomic_file

        kept = {p: r for p, r in self.entries.items() if os.path.exists(p)}
        kept = dict(list(kept.items())[-SEEN_LIMIT:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(self.path) as f:
                json.dump(kept, f)
        except OSError as e:
            log.warning("could not record verified files in %s (%s); they will be hashed again next time", self.path, e)


def check_contents(files: dict[Path, str | None], mode: str) -> tuple[list[str], int, int]:
    """Problems in the files' contents under `mode` ("full" or "changed"), files hashed, files skipped.

    `files` maps each file to the sha256 recorded for it, or None when nothing was recorded (a plain
    Hugging Face folder): such a file is only scanned for NaN/Inf.
    """
    seen = SeenFiles()
    todo, problems, skipped = [], [], 0
    for path, expected in files.items():
        known = seen.digest(path) if mode == "changed" else None
        if known is None:
            todo.append(path)
        else:
            skipped += 1
            if expected is not None and known != expected:
                problems.append(_mismatch(path))
    keys = {path: _stat_key(path) for path in todo}  # before reading: a file changed meanwhile is read again
    workers = max(1, min(4, os.cpu_count() or 1, len(todo)))
    with ThreadPoolExecutor(workers) as pool:  # hashlib and numpy release the GIL on large buffers
        results = list(pool.map(_scan_or_error, todo))
    for path, res in zip(todo, results):
        if isinstance(res, str):
            problems.append(res)
            continue
        expected = files[path]
        if expected is not None and res.sha256 != expected:
            problems.append(_mismatch(path))
        elif res.nonfinite:
            shown = ", ".join(f"{n!r} ({k} values)" for n, k in list(res.nonfinite.items())[:3])
            problems.append(f"{path}: tensor {shown} holds NaN or Inf; the weights are corrupt (or diverged in "
                            "training): restore the file from its source")
        else:
            if keys[path] is not None:
                seen.remember(path, res.sha256, keys[path])
    seen.save()
    return problems, len(todo), skipped


def _scan_or_error(path: Path) -> FileResult | str:
    try:
        return scan_file(path)
    except (OSError, ValueError) as e:
        return f"{path} could not be read to the end ({e}); the file is damaged or was changed while being checked"


def _mismatch(path: Path) -> str:
    return (f"{path} does not match the sha256 recorded when it was written (corrupted, or the record was "
            "edited); restore the file or rewrite the checkpoint")
