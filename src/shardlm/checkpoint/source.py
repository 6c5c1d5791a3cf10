"""Lazy reads from a Hugging Face safetensors checkpoint: one file or an indexed set of shards.

Only headers are read up front; `read(name, slices)` pulls exactly one slice of one tensor
through `safe_open(...).get_slice`, so a rank never materializes a tensor it does not own.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model needs; the message names file, tensor and fix."""


def weight_files(folder: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the index JSON if present, else from file headers."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
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
        for name in _open(f, ExitStack()).keys():
            names[name] = f
    return names


def _open(path: Path, stack: ExitStack):
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing; the index names it but it is not there")
    try:
        return stack.enter_context(safe_open(str(path), framework="pt"))
    except Exception as e:  # safetensors raises its own error types for bad headers and sizes
        raise CheckpointError(f"cannot read {path}: {e}; the file is truncated or not safetensors") from e


class CheckpointSource:
    """Open handles on a checkpoint's files for the duration of a `with` block."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.files = weight_files(self.folder)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> "CheckpointSource":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.folder} lacks tensor {name!r} that the model needs")
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = _open(path, self._stack)
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor `name` as recorded in its file header."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """Read one slice of tensor `name` (and only that slice)."""
        try:
            return self._handle(name).get_slice(name)[slices]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self.files[name]}: {e}") from e
