"""Random-weight checkpoints with real configs, for tests and benchmarks (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shardlm.checkpoint.writer import Entry, write_file, write_group
from shardlm.models.registry import args_for_config


def write_random_checkpoint(config: dict[str, Any], folder: Path, seed: int = 0, std: float = 0.05,
                            dtype: torch.dtype = torch.float32, max_shard_bytes: int | None = None) -> Path:
    """Write config.json and N(0, std) weights (norm weights 1) into `folder`.

    Streams: one tensor is in memory at a time, so any size can be written. Without
    `max_shard_bytes` the weights go to one `model.safetensors`; with it, to size-capped files plus
    a Hugging Face index. The values depend only on `config` and `seed`, not on the file split.
    """
    family, args = args_for_config(config)
    with torch.device("meta"):
        model = family.model_class(args)
    tied = model.tied_weight_names()
    gen = torch.Generator().manual_seed(seed)

    def produce(name: str, shape: tuple[int, ...]):
        # called in entry order by the writer, so one generator gives the same values as a dict would
        if name.endswith("norm.weight"):
            return lambda: torch.ones(shape, dtype=dtype)
        return lambda: (torch.randn(shape, generator=gen) * std).to(dtype)

    entries = [Entry(family.checkpoint_name(name), dtype, tuple(p.shape), produce(name, tuple(p.shape)))
               for name, p in model.named_parameters() if name not in tied]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if max_shard_bytes is None:
        write_file(folder / "model.safetensors", entries)
    else:
        write_group(folder, entries, max_shard_bytes)
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype).removeprefix("torch.")}, indent=2))
    return folder
