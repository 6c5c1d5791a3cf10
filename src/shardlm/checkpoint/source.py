"""Lazy reads from a Hugging Face safetensors checkpoint: one file or an indexed set of shards.

Only headers are read up front; `read(name, slices)` pulls exactly one slice of one tensor with
positioned reads (`reader.SafetensorsFile`), so a rank never holds a tensor it does not own.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import torch

from shardlm.checkpoint.reader import DTYPES, SafetensorsError, SafetensorsFile


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model needs; the message names file, tensor and fix."""


def _open(path: Path) -> SafetensorsFile:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; the index names it but it is not there")
    try:
        return SafetensorsFile(path)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from e


def weight_files(folder: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the index JSON if present, else from file headers."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid index (needs a 'weight_map' object): {e}") from e
        return {name: folder / fname for name, fname in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder} holds no safetensors weights (model.safetensors or an indexed set of shards); "
            "convert the checkpoint to safetensors first"
        )
    names: dict[str, Path] = {}
    for f in files:
        handle = _open(f)
        names.update({name: f for name in handle.keys()})
        handle.close()
    return names


class CheckpointSource:
    """Open handles on a checkpoint's files for the duration of a `with` block."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.files = weight_files(self.folder)
        self._handles: dict[Path, SafetensorsFile] = {}

    def __enter__(self) -> "CheckpointSource":
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()

    def _handle(self, name: str) -> SafetensorsFile:
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.folder} lacks tensor {name!r} that the model needs")
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = _open(path)
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

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of tensor `name`."""
        return DTYPES[self._handle(name).header[name]["dtype"]]

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """Read one slice of tensor `name` (and only that slice)."""
        try:
            return self._handle(name).read(name, slices)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from e


class RankFilesSource(CheckpointSource):
    """One rank's own files in a sharded checkpoint (`shardlm shard`): each tensor holds the rank's slice.

    `shape` reports the full tensor's shape and `read` checks that the slice asked for is the one
    stored, so the loader treats it exactly like an ordinary checkpoint and a layout mismatch is
    caught tensor by tensor.

    A stored tensor is the rank's whole slice, contiguous in its file, so `read` returns a view of
    the memory-mapped file instead of a copy (as llama.cpp and transformers do): loading costs no
    copy, and the pages are the page cache's, shared with any other reader. The files must not be
    rewritten while a model uses them (`shardlm reshard` writes a new folder).
    """

    def __init__(self, folder: Path, rank: int):
        from shardlm.checkpoint.sharded import read_rank_index

        self.root = Path(folder)
        rank_dir, self.slices = read_rank_index(self.root, rank)
        super().__init__(rank_dir)
        self._maps: dict[Path, mmap.mmap] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor `name` in the source checkpoint."""
        if name not in self.slices:
            raise CheckpointError(f"{self.folder} lacks tensor {name!r} that this rank needs: the per-rank files were "
                                  "written for a different layout; reshard them with `shardlm reshard` for this plan")
        return tuple(self.slices[name]["shape"])

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """The stored slice of `name`, which must be exactly `slices`."""
        stored = [tuple(r) for r in self.slices[name]["slices"]]
        wanted = [(s.start, s.stop) for s in slices]
        if stored != wanted:
            raise CheckpointError(f"{self.files.get(name, self.folder)} holds slice {stored} of tensor {name!r} but this "
                                  f"rank needs {wanted}: the files were written for a different layout; reshard them "
                                  "with `shardlm reshard` for this plan")
        view = self._mapped(name)
        if view is not None:
            return view
        return super().read(name, tuple(slice(0, b - a) for a, b in stored))

    def _mapped(self, name: str) -> torch.Tensor | None:
        """Tensor `name` as a view of its mapped file; None when its offset is not aligned for its dtype."""
        handle = self._handle(name)
        info = handle.header[name]
        dtype, (start, end) = DTYPES[info["dtype"]], info["data_offsets"]
        offset = handle.data_start + start
        if offset % dtype.itemsize or end == start:
            return None
        if handle.path not in self._maps:  # private and copy-on-write: nothing ever writes back to the file
            self._maps[handle.path] = mmap.mmap(handle.fd, 0, flags=mmap.MAP_PRIVATE,
                                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        flat = torch.frombuffer(self._maps[handle.path], dtype=dtype, count=(end - start) // dtype.itemsize,
                                offset=offset)
        return flat.view(tuple(info["shape"]))

    def __exit__(self, *exc) -> None:
        self._maps.clear()  # the mappings live on in the tensors that view them
        super().__exit__(*exc)


def open_source(folder: Path, rank: int) -> CheckpointSource:
    """The checkpoint source for global `rank`: its own files in a sharded checkpoint, else the whole checkpoint."""
    from shardlm.checkpoint.sharded import is_sharded

    return RankFilesSource(folder, rank) if is_sharded(folder) else CheckpointSource(folder)
