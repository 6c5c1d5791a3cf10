"""Random-weight checkpoints with real configs, for tests and benchmarks (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from shardlm.models.registry import args_for_config


def write_random_checkpoint(config: dict[str, Any], folder: Path, seed: int = 0, std: float = 0.05,
                            dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json and model.safetensors with N(0, std) weights (norm weights 1) into `folder`.

    The whole state dict is held in memory while writing: meant for models up to a few GB.
    """
    family, args = args_for_config(config)
    with torch.device("meta"):
        model = family.model_class(args)
    tied = model.tied_weight_names()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.named_parameters():
        if name in tied:
            continue
        if name.endswith("norm.weight"):
            value = torch.ones(p.shape)
        else:
            value = torch.randn(p.shape, generator=gen) * std
        tensors[family.checkpoint_name(name)] = value.to(dtype)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": str(dtype).removeprefix("torch.")}, indent=2))
    return folder
