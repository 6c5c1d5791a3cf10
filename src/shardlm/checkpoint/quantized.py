"""Quantized checkpoints: `shardlm convert --quantization int8|int4` writes them, ranks load their slices.

Format: safetensors with the float checkpoint's names, each quantized linear weight `X.weight` as
- int8: `X.weight` I8 (out, in) and `X.weight_scale` BF16 (out,);
- int4: `X.weight` U8 (out, ceil(in / 2)), two codes per byte along the input (even column in the
  low nibble), with `X.weight_scale` and `X.weight_zero` BF16 (out, ceil(in / 32)): w ~ (q - 8) *
  scale + zero for the groups of 32 input columns counted from column 0.
config.json carries `"quantization_config": {"quant_method": "shardlm", "bits": 8 | 4, "group_size": 32}`.

The codes and scales are the ones quantizing at load computes (shardlm.quant), so a model loaded
from such a checkpoint is bitwise the model `--quantization` builds, at any tp. A rank reads only
its rows, and for a row-parallel layer only the groups its columns touch (a group is 16 bytes of
codes per row, so a column range is always read as whole bytes).
"""

from __future__ import annotations

import torch

from shardlm.quant import (ACT_DTYPE, INT4_GROUP, Int4Weight, Int8Weight, int4_codes, int8_codes, pack_int4,
                           pack_int8)



def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes (out, in) in 0..15 -> bytes (out, ceil(in / 2)), even columns in the low nibble."""
    q = q.to(torch.uint8)
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1), value=8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """Bytes (out, m) -> codes (out, 2m) int32."""
    b = b.to(torch.int32)
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[0], -1)  # (out, m, 2) -> (out, 2m)


def stored_tensors(name: str, w: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """The tensors a quantized checkpoint stores for float weight `name` (out, in)."""
    base = name.removesuffix(".weight")
    if kind == "int8":
        q, scale = int8_codes(w)
        return {name: q, f"{base}.weight_scale": scale.to(ACT_DTYPE)}
    q, scale, zero, _, _ = int4_codes(w)
    return {name: pack_nibbles(q[:, :w.shape[1]]), f"{base}.weight_scale": scale.to(ACT_DTYPE),
            f"{base}.weight_zero": zero.to(ACT_DTYPE)}


def read_quantized(src, name: str, kind: str, rows: slice, cols: slice, in_total: int,
                   device: torch.device | str = "cpu") -> Int8Weight | Int4Weight:
    """This rank's part (`rows` x `cols` of the logical (out, in_total) weight) of quantized `name`,
    packed for `device`'s kernel."""
    base = name.removesuffix(".weight")
    if kind == "int8":
        q = src.read(name, (rows, cols))
        scale = src.read(f"{base}.weight_scale", (rows,))
        return pack_int8(q, scale, device)
    g0, g1 = cols.start // INT4_GROUP, -(-cols.stop // INT4_GROUP)
    stored_cols = -(-in_total // 2)
    b0, b1 = g0 * INT4_GROUP // 2, min(g1 * INT4_GROUP // 2, stored_cols)
    q = unpack_nibbles(src.read(name, (rows, slice(b0, b1))))  # (out, covered columns)
    width = (g1 - g0) * INT4_GROUP
    if q.shape[1] < width:  # the last group runs past the tensor: codes for columns that meet zeros
        q = torch.nn.functional.pad(q, (0, width - q.shape[1]), value=8)
    scale = src.read(f"{base}.weight_scale", (rows, slice(g0, g1))).float()
    zero = src.read(f"{base}.weight_zero", (rows, slice(g0, g1))).float()
    # the columns of neighbouring ranks inside the edge groups stay: they meet the zero padding of x
    return pack_int4(q, scale, zero, INT4_GROUP, cols.start - g0 * INT4_GROUP, g1 * INT4_GROUP - cols.stop, device)
