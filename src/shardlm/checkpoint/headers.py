"""Safetensors headers and checkpoint file maps, without torch.

What can be checked before any tensor is read (which tensors a checkpoint holds, their shapes,
whether each file's header agrees with its size) is checked here, so the driver can refuse a bad
checkpoint before a rank starts and without importing torch. Reading tensors is `reader.py`'s job.
The format: an 8-byte little-endian header length, a JSON header, then raw data.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
"""Bytes per element of every safetensors dtype shardlm reads."""
INDEX_NAME = "model.safetensors.index.json"
"""The Hugging Face index of a sharded checkpoint (`metadata`, `weight_map`)."""


class SafetensorsError(ValueError):
    """A safetensors file whose header or size is inconsistent; names the file and the tensor."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model needs; the message names file, tensor and fix."""


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: a header naming one key twice hides a tensor, so it is refused."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the header names {key!r} twice")
        out[key] = value
    return out


def _entry_span(path: Path, name: str, info: object) -> tuple[int, int]:
    """(start, stop) of one header entry's data, after checking dtype, shape and offsets agree."""
    if not isinstance(info, dict):
        raise SafetensorsError(f"{path}: header entry {name!r} is not an object; the header is corrupt")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    itemsize = ITEMSIZES.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r} (known: "
                               f"{', '.join(ITEMSIZES)})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SafetensorsError(f"{path}: tensor {name!r} has shape {shape!r}; a shape is a list of sizes >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise SafetensorsError(f"{path}: tensor {name!r} has data_offsets {offsets!r}; they must be [start, stop] "
                               "with 0 <= start <= stop")
    start, stop = offsets
    numel = 1
    for d in shape:
        numel *= d
    if stop - start != numel * itemsize:
        raise SafetensorsError(f"{path}: tensor {name!r} header says offsets {start}..{stop} ({stop - start} bytes) "
                               f"for shape {shape} {dtype}, which is {numel * itemsize} bytes; the header lies about "
                               "offsets")
    return start, stop


class SafetensorsHeader:
    """The validated header of one safetensors file, with its descriptor left open for reads."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            self.size = os.fstat(self.fd).st_size
            self.header, self.data_start = self._read_header()
            self._validate()
        except BaseException:
            os.close(self.fd)
            raise

    def _read_header(self) -> tuple[dict, int]:
        raw = os.pread(self.fd, 8, 0)
        if len(raw) < 8:
            raise SafetensorsError(f"{self.path} is {self.size} bytes, too short for a safetensors header; "
                                   "the file is truncated")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > self.size:
            raise SafetensorsError(f"{self.path} declares a {n}-byte header but is only {self.size} bytes; "
                                   "the file is truncated or not safetensors")
        try:
            header = json.loads(os.pread(self.fd, n, 8), object_pairs_hook=_no_duplicates)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise SafetensorsError(f"{self.path} has an unreadable header ({e}); the file is not safetensors") from e
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: the header is a JSON {type(header).__name__}, not an object; "
                                   "the file is not safetensors")
        header.pop("__metadata__", None)
        return header, 8 + n

    def _validate(self) -> None:
        """Every entry well-formed, dtype x shape = its byte length, and the data regions tiling the
        data section exactly: in bounds, no two tensors sharing bytes, no gap, nothing after the last."""
        data_len = self.size - self.data_start
        spans = sorted((_entry_span(self.path, name, info), name) for name, info in self.header.items())
        end, last = 0, None
        for (start, stop), name in spans:  # first pass: bounds and shared bytes, the dangerous lies
            if stop > data_len:
                raise SafetensorsError(f"{self.path}: tensor {name!r} ends at byte {stop} of the data but the file "
                                       f"holds {data_len}; the file is truncated")
            if start < end:
                raise SafetensorsError(f"{self.path}: tensors {last!r} and {name!r} share bytes {start}..{min(end, stop)} "
                                       "of the data (overlapping data_offsets); the header is corrupt or forged")
            if stop >= end:
                end, last = stop, name
        pos = 0
        for (start, stop), name in spans:  # second pass: the tensors tile the data with no gap
            if start > pos:
                raise SafetensorsError(f"{self.path}: bytes {pos}..{start} of the data belong to no tensor (before "
                                       f"{name!r}); the header lies about offsets")
            pos = stop
        if pos != data_len:
            raise SafetensorsError(f"{self.path} has {data_len - pos} bytes after its last tensor's data; the file "
                                   "was appended to or its header lies about offsets")

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def keys(self) -> list[str]:
        """Tensor names in this file."""
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor `name`."""
        return tuple(self.header[name]["shape"])


def open_checked(path: Path, cls: type[SafetensorsHeader] = SafetensorsHeader) -> SafetensorsHeader:
    """`cls(path)`, with a missing file or a bad header raised as CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; the index names it but it is not there")
    try:
        return cls(path)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from e


def weight_files(folder: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the index JSON if present, else from file headers."""
    from shardlm.checkpoint.contain import inside  # contain.py imports this module's errors

    folder = Path(folder)
    index = inside(folder, INDEX_NAME, f"the folder {folder}")
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid index (needs a 'weight_map' object): {e}") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} is not a valid index: 'weight_map' must map tensor names to file names")
        return {name: inside(folder, fname, f"the index {index} (tensor {name!r})") for name, fname in weight_map.items()}
    files = [inside(folder, f.name, f"the folder entry {f}") for f in sorted(folder.glob("*.safetensors"))]
    if not files:
        raise CheckpointError(
            f"{folder} holds no safetensors weights (model.safetensors or an indexed set of shards); "
            "convert the checkpoint to safetensors first"
        )
    names: dict[str, Path] = {}
    for f in files:
        handle = open_checked(f)
        names.update({name: f for name in handle.keys()})
        handle.close()
    return names


class HeaderSource:
    """A checkpoint's tensor names and shapes from its headers, for the duration of a `with` block.

    `handle_class` is what each file is opened as (reader.SafetensorsFile adds reads)."""

    handle_class: type[SafetensorsHeader] = SafetensorsHeader

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.files = weight_files(self.folder)
        self._handles: dict[Path, SafetensorsHeader] = {}

    def __enter__(self) -> "HeaderSource":
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()

    def _handle(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.folder} lacks tensor {name!r} that the model needs")
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = open_checked(path, self.handle_class)
        handle = self._handles[path]
        if name not in handle.header:
            raise CheckpointError(f"{path} does not hold tensor {name!r} although the index says it does")
        return handle

    def names(self) -> list[str]:
        """Every tensor name the checkpoint holds."""
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor `name` as recorded in its file header."""
        return self._handle(name).shape(name)

    def dtype_name(self, name: str) -> str:
        """Safetensors dtype of tensor `name` as recorded in its file header, e.g. "F32"."""
        return self._handle(name).header[name]["dtype"]
