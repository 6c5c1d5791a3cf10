"""Read any slice of any tensor of a checkpoint, whether it is an ordinary one or per-rank files.

`open_reader` gives the same interface for both, so shard, reshard, consolidate and convert are
one code path: a per-rank reader assembles a slice from the pieces the ranks hold (each piece read
with positioned reads, only the overlapping part), never the whole model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from shardlm.checkpoint.sharded import is_sharded, read_info, read_rank_index
from shardlm.checkpoint.headers import CheckpointError
from shardlm.checkpoint.source import CheckpointSource


class PlainReader:
    """An ordinary Hugging Face checkpoint folder (one file or an indexed set)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.src = CheckpointSource(self.folder)

    def names(self) -> list[str]:
        """Every tensor name."""
        return list(self.src.files)

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of `name`."""
        return self.src.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of `name`."""
        return self.src.dtype(name)

    def dtype_name(self, name: str) -> str:
        """Stored safetensors dtype of `name`, e.g. "F32"."""
        return self.src.dtype_name(name)

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """One slice of `name`."""
        return self.src.read(name, slices)

    def close(self) -> None:
        """Close every open file."""
        self.src.__exit__(None, None, None)


class PerRankReader:
    """Per-rank files (`shardlm shard`): a slice is assembled from the ranks' stored pieces."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.info = read_info(self.folder)
        self.pieces: dict[str, list[tuple[int, list[tuple[int, int]]]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.srcs: dict[int, CheckpointSource] = {}
        for rank in range(len(self.info.ranks)):
            _, slices = read_rank_index(self.folder, rank)
            for name, rec in slices.items():
                shape = tuple(rec["shape"])
                if self.shapes.setdefault(name, shape) != shape:
                    raise CheckpointError(f"{self.folder}: ranks disagree on the full shape of {name!r} "
                                          f"({list(self.shapes[name])} vs {list(shape)}); the files are corrupt")
                self.pieces.setdefault(name, []).append((rank, [tuple(r) for r in rec["slices"]]))

    def _src(self, rank: int) -> CheckpointSource:
        if rank not in self.srcs:
            self.srcs[rank] = CheckpointSource(read_rank_index(self.folder, rank)[0])
        return self.srcs[rank]

    def names(self) -> list[str]:
        """Every tensor name some rank holds."""
        return list(self.pieces)

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of `name` in the model."""
        if name not in self.shapes:
            raise CheckpointError(f"no rank of {self.folder} holds tensor {name!r}")
        return self.shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of `name`."""
        return self._src(self.pieces[name][0][0]).dtype(name)

    def dtype_name(self, name: str) -> str:
        """Stored safetensors dtype of `name` (as the first rank holding it stores it), e.g. "F32"."""
        return self._src(self.pieces[name][0][0]).dtype_name(name)

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """The slice of the full tensor `name`, copied together from the pieces that overlap it."""
        want = [(s.start, s.stop) for s in slices]
        out = torch.empty([b - a for a, b in want], dtype=self.dtype(name))
        covered = torch.zeros(out.shape, dtype=torch.bool)
        for rank, have in self.pieces[name]:
            inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, have)]
            if any(a >= b for a, b in inter):
                continue
            dst = tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(inter, want))
            if bool(covered[dst].all()):
                continue  # a replica of what another rank already gave
            src_slices = tuple(slice(a - h, b - h) for (a, b), (h, _) in zip(inter, have))
            out[dst] = self._src(rank).read(name, src_slices)
            covered[dst] = True
        if not bool(covered.all()):
            raise CheckpointError(f"the per-rank files in {self.folder} do not cover {name!r} {want}: "
                                  f"{int((~covered).sum())} elements are in no rank's slice; the files are incomplete")
        return out

    def close(self) -> None:
        """Close every open file."""
        for s in self.srcs.values():
            s.__exit__(None, None, None)
        self.srcs.clear()


def open_reader(folder: Path) -> PlainReader | PerRankReader:
    """A reader for an ordinary checkpoint or for per-rank files."""
    return PerRankReader(folder) if is_sharded(folder) else PlainReader(folder)


def source_identity(folder: Path, reader) -> str:
    """sha256 over config.json and every tensor's name and full shape: names the model, not the copy or dtype.

    Per-rank files carry the identity of the checkpoint they came from, so it survives resharding.
    """
    if isinstance(reader, PerRankReader) and reader.info.source.get("identity"):
        return reader.info.source["identity"]
    h = hashlib.sha256((Path(folder) / "config.json").read_bytes())
    for name in sorted(reader.names()):
        h.update(json.dumps([name, list(reader.shape(name))]).encode())
    return h.hexdigest()
