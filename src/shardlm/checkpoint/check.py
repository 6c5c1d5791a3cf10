"""Preflight: does a checkpoint hold every tensor the model needs, with the shapes config.json implies?

Reads only safetensors headers, so the driver can refuse a bad checkpoint before any rank starts.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from shardlm.checkpoint.headers import CheckpointError, HeaderSource
from shardlm.models.args import ModelArgs, read_config
from shardlm.models.inventory import tensor_inventory
from shardlm.models.registry import Family
from shardlm.quant_spec import checkpoint_quantization, is_quantizable, stored_shapes


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
"""Safetensors dtypes a float tensor may be stored as."""


CODE_DTYPES = {"int8": ("I8",), "int4": ("U8",)}
"""Dtypes of a quantized weight's codes (its scales and zeros are float)."""


def check_checkpoint(folder: Path, family: Family, args: ModelArgs, reader=None) -> None:
    """Raise CheckpointError naming the file and tensor of the first problems found (up to 5).

    `reader` (anything with `names()` and `shape(name)`, e.g. a per-rank reader) replaces the
    folder's ordinary checkpoint files as the source of tensor names and shapes.
    """
    kind = checkpoint_quantization(read_config(folder)) if (Path(folder) / "config.json").is_file() else None
    problems: list[str] = []
    with HeaderSource(folder) if reader is None else nullcontext(reader) as src:
        have = set(src.names())
        files = getattr(src, "files", {})
        for t in tensor_inventory(args):  # every tensor the model reads; a tied head is the embedding
            ck = family.checkpoint_name(t.name)
            expected = {ck: t.shape}
            if kind and ck.endswith(".weight") and len(t.shape) == 2 and is_quantizable(ck.removesuffix(".weight")):
                expected = stored_shapes(ck, t.shape, kind)
            for want, want_shape in expected.items():
                if want not in have:
                    problems.append(f"tensor {want!r} is missing")
                    continue
                shape = tuple(src.shape(want))
                where = f" in {files[want].name}" if want in files else ""
                if shape != want_shape:
                    problems.append(f"tensor {want!r}{where} has shape {list(shape)} but config.json "
                                    f"implies {list(want_shape)}")
                allowed = CODE_DTYPES[kind] if want == ck and len(expected) > 1 else FLOAT_DTYPES
                dtype = src.dtype_name(want)
                if dtype not in allowed:
                    problems.append(f"tensor {want!r}{where} is stored as {dtype} but it must be "
                                    f"{'/'.join(allowed)}; the header was altered or the file is not this model's")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"checkpoint {folder} does not match its config.json: " + "; ".join(problems[:5]) + more
                              + "; the weights and config.json come from different models, or the download is incomplete")
