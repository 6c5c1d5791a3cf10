"""`shardlm inspect`: what a model is made of and how many bytes it needs, from its config alone."""

from __future__ import annotations

from typing import Any

from shardlm.models.args import ModelArgs
from shardlm.models.inventory import TensorInfo, parameter_count, tensor_inventory
from shardlm.models.registry import Family
from shardlm.plan.memory import DTYPE_BYTES, tensor_bytes

FORMATS = (("float32", "none"), ("bfloat16", "none"), ("float16", "none"), ("bfloat16", "int8"),
           ("bfloat16", "int4"))
"""(dtype, quantization) pairs reported; int8/int4 quantize linear weights and keep the rest in bfloat16."""


def _bytes(tensors: list[TensorInfo], dtype: str, quant: str) -> int:
    return sum(tensor_bytes(t, t.shape, dtype, quant) for t in tensors)


def _format_name(dtype: str, quant: str) -> str:
    return quant if quant != "none" else dtype


def inspect_model(name: str, family: Family, args: ModelArgs) -> dict[str, Any]:
    """A JSON-ready description: shape, parameters, bytes per format, per-layer sizes, largest unit, KV per token."""
    inv = tensor_inventory(args)
    layer0 = [t for t in inv if t.layer == 0]
    units = {"embedding": [t for t in inv if t.part == "embed"], "decoder layer": layer0,
             "final norm": [t for t in inv if t.layer is None and t.part == "norm"],
             "lm head": [t for t in inv if t.part == "head"] or [t for t in inv if t.part == "embed"]}
    parts = {}
    for t in layer0:
        parts.setdefault(t.part, []).append(t)
    sizes = {f: {u: _bytes(ts, d, q) for u, ts in units.items()} for d, q in FORMATS for f in [_format_name(d, q)]}
    largest = max(units, key=lambda u: sizes["bfloat16"][u])
    kv_token = {d: 2 * args.n_layers * args.n_kv_heads * args.head_dim * DTYPE_BYTES[d] for d in ("float32", "bfloat16")}
    return {
        "model": name, "architecture": args.architecture, "family": family.name,
        "runnable": family.model_ref is not None,
        "parameters": parameter_count(args),
        "shape": {"layers": args.n_layers, "hidden": args.dim, "heads": args.n_heads, "kv_heads": args.n_kv_heads,
                  "head_dim": args.head_dim, "intermediate": args.intermediate_size, "vocab": args.vocab_size,
                  "experts": args.n_experts, "experts_per_token": args.experts_per_token,
                  "tied_embeddings": args.tie_embeddings, "max_position_embeddings": args.max_seq_len},
        "bytes": {_format_name(d, q): _bytes(inv, d, q) for d, q in FORMATS},
        "units": sizes,
        "layer_parts_bfloat16": {p: _bytes(ts, "bfloat16", "none") for p, ts in parts.items()},
        "largest_unit": {"name": largest, "bytes_bfloat16": sizes["bfloat16"][largest]},
        "kv_cache_bytes_per_token": kv_token,
    }
