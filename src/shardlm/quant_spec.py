"""Quantization kinds, what they apply to, and how a quantized checkpoint records them (torch-free).

The arithmetic and the kernels are in `shardlm.quant`; the stored layout in
`shardlm.checkpoint.quantized`. What the driver and the planner need to check a request or count
bytes is here, so that neither imports torch.
"""

from __future__ import annotations

from typing import Any

from shardlm.models.args import ModelConfigError

KINDS = ("int8", "int4")
INT4_GROUP = 32
"""Input columns per int4 scale/zero pair (the kernel accepts 32, 64, 128 or 256)."""
INT8_ALIGN = 32
"""The int8 kernel's input width must be a multiple of this."""
QUANTIZED_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
QUANT_METHOD = "shardlm"
"""quantization_config.quant_method of the checkpoints `shardlm convert --quantization` writes."""


class QuantizationError(ValueError):
    """A quantization this model or device cannot run."""


def check_kind(kind: str | None, device: object = "cpu") -> None:
    """Raise QuantizationError for an unknown kind or one `device` cannot run."""
    if kind in (None, "none"):
        return
    if kind not in KINDS:
        raise QuantizationError(f"--quantization {kind} is not supported; use none, int8 or int4")
    if str(device).split(":")[0] not in ("cpu", "cuda"):
        raise QuantizationError(f"--quantization {kind} runs on cpu and cuda ranks, not on {device}; "
                                "use --quantization none there")


def is_quantizable(name: str) -> bool:
    """True for the linear layers we quantize (attention and MLP projections, an untied LM head)."""
    return name.rsplit(".", 1)[-1] in QUANTIZED_SUFFIXES


def linear_bytes(rows: int, cols: int, kind: str, col_start: int = 0, device_kind: str = "cpu") -> int:
    """Bytes a quantized linear weight of `rows` x `cols` holds in memory in the kernels' format
    (shardlm.quant), padding included; `col_start` is its first column in the full weight (a
    row-parallel slice), since int4 groups count from column 0 of the full tensor.

    int8: codes padded to a multiple of INT8_ALIGN columns plus one scale per row (bfloat16 on CUDA; on the CPU
    float32, which our kernels read without converting).
    int4: two codes per byte over whole groups (a slice starting or ending inside a group is padded
    to whole groups), a bfloat16 scale and zero per (group, row); rows are padded to a multiple of 16, for
    torch's kernel on CUDA and for the row tiles of ours on the CPU.
    """
    if kind == "int8":
        return rows * (cols + -cols % INT8_ALIGN) + rows * (2 if device_kind == "cuda" else 4)
    if kind != "int4":
        raise QuantizationError(f"no quantized size for {kind!r}; use int8 or int4")
    groups = -(-(col_start % INT4_GROUP + cols) // INT4_GROUP)
    padded_rows = rows + -rows % 16
    return padded_rows * (groups * INT4_GROUP // 2 + groups * 4)


def checkpoint_quantization(cfg: dict[str, Any]) -> str | None:
    """"int8"/"int4" for a shardlm-quantized checkpoint's config, None for a float one."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise ModelConfigError(f"config.json has quantization_config with quant_method {method!r}; shardlm reads "
                               f"float checkpoints and its own ({QUANT_METHOD!r}, from `shardlm convert "
                               "--quantization`); give the float checkpoint and quantize with --quantization")
    bits, group = qc.get("bits"), qc.get("group_size", INT4_GROUP)
    if bits not in (8, 4) or (bits == 4 and group != INT4_GROUP):
        raise ModelConfigError(f"quantization_config bits {bits}, group_size {group} is not one shardlm writes "
                               f"(8, or 4 with group_size {INT4_GROUP}); convert the float checkpoint again")
    return "int8" if bits == 8 else "int4"


def config_entry(kind: str) -> dict[str, Any]:
    """The quantization_config a checkpoint of `kind` records."""
    return {"quant_method": QUANT_METHOD, "bits": 8 if kind == "int8" else 4, "group_size": INT4_GROUP}


def stored_shapes(name: str, shape: tuple[int, int], kind: str) -> dict[str, tuple[int, ...]]:
    """Shapes `stored_tensors` gives for a weight of logical `shape` (out, in)."""
    out, k = shape
    base = name.removesuffix(".weight")
    if kind == "int8":
        return {name: (out, k), f"{base}.weight_scale": (out,)}
    groups = -(-k // INT4_GROUP)
    return {name: (out, -(-k // 2)), f"{base}.weight_scale": (out, groups), f"{base}.weight_zero": (out, groups)}
