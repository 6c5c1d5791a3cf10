"""Preflight: does a checkpoint hold every tensor the model needs, with the shapes config.json implies?

Reads only safetensors headers, so the driver can refuse a bad checkpoint before any rank starts.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from shardlm.checkpoint.source import CheckpointError, CheckpointSource
from shardlm.models.args import ModelArgs
from shardlm.models.registry import Family


def check_checkpoint(folder: Path, family: Family, args: ModelArgs, reader=None) -> None:
    """Raise CheckpointError naming the file and tensor of the first problems found (up to 5).

    `reader` (anything with `names()` and `shape(name)`, e.g. a per-rank reader) replaces the
    folder's ordinary checkpoint files as the source of tensor names and shapes.
    """
    with torch.device("meta"):
        model = family.model_class(args)
    tied = model.tied_weight_names()
    problems: list[str] = []
    with CheckpointSource(folder) if reader is None else nullcontext(reader) as src:
        have = set(src.names())
        files = getattr(src, "files", {})
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in tied:
                continue
            ck = family.checkpoint_name(name)
            if ck not in have:
                problems.append(f"tensor {ck!r} is missing")
                continue
            shape = tuple(src.shape(ck))
            if shape != tuple(param.shape):
                where = f" in {files[ck].name}" if ck in files else ""
                problems.append(f"tensor {ck!r}{where} has shape {list(shape)} but config.json "
                                f"implies {list(param.shape)}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"checkpoint {folder} does not match its config.json: " + "; ".join(problems[:5]) + more
                              + "; the weights and config.json come from different models, or the download is incomplete")
