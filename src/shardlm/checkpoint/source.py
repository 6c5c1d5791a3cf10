"""Lazy reads from a Hugging Face safetensors checkpoint: one file or an indexed set of shards.

Only headers are read up front; `read(name, slices)` pulls exactly one slice of one tensor with
positioned reads (`reader.SafetensorsFile`), so a rank never holds a tensor it does not own.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from shardlm.checkpoint.headers import CheckpointError, HeaderSource, SafetensorsError
from shardlm.checkpoint.reader import DTYPES, SafetensorsFile


class CheckpointSource(HeaderSource):
    """Open handles on a checkpoint's files for the duration of a `with` block: names, shapes, reads."""

    handle_class = SafetensorsFile

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
