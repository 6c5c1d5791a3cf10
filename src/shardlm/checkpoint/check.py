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
    from shardlm.checkpoint.quantized import checkpoint_quantization, stored_shapes
    from shardlm.models.args import read_config
    from shardlm.quant import is_quantizable

    kind = checkpoint_quantization(read_config(folder)) if (Path(folder) / "config.json").is_file() else None
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
            expected = {ck: tuple(param.shape)}
            if kind and ck.endswith(".weight") and param.dim() == 2 and is_quantizable(ck.removesuffix(".weight")):
                expected = stored_shapes(ck, tuple(param.shape), kind)
            for want, want_shape in expected.items():
                if want not in have:
                    problems.append(f"tensor {want!r} is missing")
                    continue
                shape = tuple(src.shape(want))
                if shape != want_shape:
                    where = f" in {files[want].name}" if want in files else ""
                    problems.append(f"tensor {want!r}{where} has shape {list(shape)} but config.json "
                                    f"implies {list(want_shape)}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"checkpoint {folder} does not match its config.json: " + "; ".join(problems[:5]) + more
                              + "; the weights and config.json come from different models, or the download is incomplete")
