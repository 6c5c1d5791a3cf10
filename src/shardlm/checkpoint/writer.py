"""Streaming, size-capped safetensors writer: one tensor in memory at a time, checksums as it writes.

Tensors are packed in the order given into files of at most `max_bytes` (a tensor larger than the
cap gets a file of its own). Each file is written under a temporary name in the target folder
(`.NAME.tmp-PID`), fsynced and renamed; the Hugging Face index (`metadata`, `weight_map`) is
written after every file it names. The header is known before any data (shapes and dtypes are),
so the data streams straight to disk: peak memory is the largest single tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from shardlm.atomic import atomic_file
from shardlm.checkpoint.headers import INDEX_NAME

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
TMP_MARK = ".tmp-"


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its name, dtype and shape, and how to produce its data when its turn comes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


def pack(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Split `entries` (in order) into files of at most `max_bytes` of data each."""
    files: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if files[-1] and size + e.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += e.nbytes
    return [f for f in files if f]


def tmp_name(path: Path) -> Path:
    """The temporary name `path` is written under before its rename."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def _header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write_file(path: Path, entries: list[Entry], on_bytes: Callable[[int], None] | None = None) -> dict:
    """Write one safetensors file atomically; returns {"bytes", "sha256"} of what was written."""
    digest, total = hashlib.sha256(), 0
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            head = _header(entries, {"format": "pt"})
            f.write(head)
            digest.update(head)
            total += len(head)
            for e in entries:
                t = e.produce()
                if tuple(t.shape) != e.shape:
                    raise ValueError(f"tensor {e.name!r} came out {list(t.shape)}, expected {list(e.shape)}")
                data = memoryview(t.to(e.dtype).contiguous().view(-1).view(torch.uint8).numpy())
                f.write(data)
                digest.update(data)
                total += len(data)
                if on_bytes is not None:
                    on_bytes(len(data))
                del t, data
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno and not e.filename:  # a failed write names no file: name the one being written
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    return {"bytes": total, "sha256": digest.hexdigest()}


def write_group(folder: Path, entries: list[Entry], max_bytes: int, index_metadata: dict | None = None,
                on_bytes: Callable[[int], None] | None = None, checksums_in_index: bool = False) -> dict[str, dict]:
    """Write `entries` as size-capped files `model-0000i-of-0000n.safetensors` plus the index, index last.

    Returns {file name: {"bytes", "sha256"}} for every file written, the index included. With
    `checksums_in_index` the index metadata also records each data file's bytes and sha256
    (`shardlm_files`), for folders that have no shardlm.json.
    """
    folder.mkdir(parents=True, exist_ok=True)
    groups = pack(entries, max_bytes)
    n = len(groups)
    written, weight_map = {}, {}
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        written[fname] = write_file(folder / fname, group, on_bytes)
        weight_map.update({e.name: fname for e in group})
    meta = {"total_size": sum(e.nbytes for e in entries), **(index_metadata or {})}
    if checksums_in_index:
        meta["shardlm_files"] = dict(written)
    index = {"metadata": meta, "weight_map": weight_map}
    raw = json.dumps(index, indent=2).encode()
    with atomic_file(folder / INDEX_NAME, "wb") as f:
        f.write(raw)
    written[INDEX_NAME] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    return written
