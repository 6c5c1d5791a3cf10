"""Bytes per rank: weights (by the same slicing rules the loader uses), KV cache, activations.

Nothing here allocates; everything is computed from ModelArgs and the family's TP plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlm.models.args import ModelArgs
from shardlm.models.inventory import TensorInfo, layer_tensors, outer_tensors
from shardlm.parallel.split import HeadSplit, block_range, split_range
from shardlm.parallel.styles import ShardCoord, Style, param_slices
from shardlm.quant_spec import linear_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def tensor_bytes(t: TensorInfo, shape: tuple[int, ...], dtype: str, quant: str, col_start: int = 0,
                 device_kind: str = "cpu") -> int:
    """Bytes of (a slice of) tensor `t` with `shape`, held in `dtype` or quantized.

    Weight-only quantization touches linear weights only, in the runtime's in-memory format with its
    padding (`quant_spec.linear_bytes`: int8 with a scale per output row; int4 packed two per byte
    with a scale and a zero point per group of input columns). `col_start` is the slice's first
    column in the full weight; `device_kind` ("cpu", "cuda") picks the kernel's layout. Embeddings, norms,
    biases and routers stay in `dtype`.
    """
    if quant == "none" or not t.linear or len(shape) != 2:
        return math.prod(shape) * DTYPE_BYTES[dtype]
    return linear_bytes(shape[0], shape[1], quant, col_start, device_kind)


@dataclass(frozen=True)
class ShardWeights:
    """Weight bytes one tensor-parallel rank holds, by part."""

    embed: int
    """Its slice of the token embedding."""
    layer: int
    """One decoder layer (all layers have the same shape)."""
    final_norm: int
    """The final RMSNorm (replicated)."""
    head: int
    """Its slice of the LM head; equals `embed` when the head is tied to the embedding."""
    tied: bool
    """The head is the embedding (one tensor when both live on the same stage)."""
    layer_params: int
    """Parameters of one decoder layer on this rank (for FLOP counts)."""
    head_params: int
    """Parameters of the LM head slice on this rank."""
    experts: int = 0
    """Bytes of `layer` that are mixture-of-experts weights (read only for experts a token is routed to)."""
    layer_fixed: int = 0
    """Bytes of `layer` that are not linear weights (norms, biases, a router): they stay resident when
    the layer streams in from an offload tier."""

    @property
    def layer_streamed(self) -> int:
        """Bytes of one layer that stream in when it is offloaded (its linear weights)."""
        return self.layer - self.layer_fixed


def _sliced(t: TensorInfo, plan: dict[str, Style], coord: ShardCoord) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in param_slices(t.name, t.shape, plan, coord))


def _slice_bytes(t: TensorInfo, plan: dict[str, Style], coord: ShardCoord, dtype: str, quant: str,
                 device_kind: str) -> int:
    """Bytes of the slice of `t` rank `coord` holds (quantized with its own column offset)."""
    slices = param_slices(t.name, t.shape, plan, coord)
    shape = tuple(s.stop - s.start for s in slices)
    return tensor_bytes(t, shape, dtype, quant, slices[-1].start if len(slices) == 2 else 0, device_kind)


def shard_weights(args: ModelArgs, plan: dict[str, Style], tp: int, tp_rank: int, dtype: str,
                  quant: str, device_kind: str = "cpu", embedding: str = "float") -> ShardWeights:
    """Weight bytes of rank `tp_rank` of `tp` on a `device_kind` device ("cpu", "cuda": the quantized layouts
    differ), from the family's TP plan (replicated parts included). `embedding` "int8": the embedding slice (and
    a head tied to it) as int8 rows with a scale each."""
    coord = ShardCoord.for_model(args, tp_rank, tp)
    layer = layer_tensors(args, 0)
    shapes = {t.name: _sliced(t, plan, coord) for t in layer}
    others = outer_tensors(args)
    emb = others["embed"]
    emb_shape = _sliced(emb, plan, coord)
    emb_b = linear_bytes(*emb_shape, "int8", device_kind=device_kind) if embedding == "int8" else tensor_bytes(emb, emb_shape, dtype, "none")
    head = others.get("head")
    head_shape = _sliced(head or emb, plan, coord)  # a tied head is the embedding's vocabulary slice
    return ShardWeights(
        embed=emb_b,
        layer=sum(_slice_bytes(t, plan, coord, dtype, quant, device_kind) for t in layer),
        final_norm=tensor_bytes(others["norm"], others["norm"].shape, dtype, "none"),
        head=tensor_bytes(head, head_shape, dtype, quant, device_kind=device_kind) if head else emb_b,
        tied=head is None,
        layer_params=sum(math.prod(shapes[t.name]) for t in layer if t.part != "experts")
        + _active_expert_params(args, layer, shapes),
        head_params=math.prod(head_shape),
        experts=sum(_slice_bytes(t, plan, coord, dtype, quant, device_kind) for t in layer if t.part == "experts"),
        layer_fixed=sum(_slice_bytes(t, plan, coord, dtype, quant, device_kind) for t in layer if not t.linear),
    )


def _active_expert_params(args: ModelArgs, layer: list[TensorInfo], shapes: dict) -> int:
    """Expert parameters one token touches: experts_per_token of n_experts (0 for dense models)."""
    total = sum(math.prod(shapes[t.name]) for t in layer if t.part == "experts")
    return total * args.experts_per_token // args.n_experts if args.n_experts else 0


def stage_weight_bytes(w: ShardWeights, n_layers: int, first: bool, last: bool) -> int:
    """Resident weight bytes of a rank whose stage runs `n_layers` layers."""
    total = n_layers * w.layer
    if first:
        total += w.embed
    if last:
        total += w.final_norm + (0 if (w.tied and first) else w.head)
    return total


def kv_bytes(args: ModelArgs, tp: int, tp_rank: int, n_layers: int, batch: int, seq: int, dtype: str) -> int:
    """KV cache of one rank: keys and values for its KV heads, its layers, batch x seq tokens."""
    a, b = HeadSplit(args.n_heads, args.n_kv_heads, tp).kv_range(tp_rank)
    return 2 * n_layers * batch * (b - a) * seq * args.head_dim * DTYPE_BYTES[dtype]


def activation_bytes(args: ModelArgs, tp: int, tp_rank: int, batch: int, chunk: int, context: int,
                     dtype: str, last: bool) -> int:
    """Peak activations of one forward of batch x chunk tokens attending to `context` positions.

    Residual stream and normed input stay live; on top the larger of the attention phase (q, k, v
    with their rotated copies, the output, the boolean mask, and per-query-head K/V copies when
    the head split is irregular), the MLP phase (gate, up, product) and, on the last stage, the
    float32 logits of the last position (local slice plus the gathered full row).
    """
    e = DTYPE_BYTES[dtype]
    split = HeadSplit(args.n_heads, args.n_kv_heads, tp)
    q0, q1 = split.q_range(tp_rank)
    k0, k1 = split.kv_range(tp_rank)
    hq, hkv, hd = q1 - q0, k1 - k0, args.head_dim
    tokens = batch * chunk
    resid = 2 * tokens * args.dim * e
    attn = tokens * (2 * hq + 4 * hkv) * hd * e + batch * chunk * context
    g = split.group
    if hkv > 1 and (q0 % g or q1 % g):
        attn += 2 * batch * hq * context * hd * e  # irregular groups gather K/V per query head
    f0, f1 = block_range(args.intermediate_size, tp, tp_rank)  # the MLP styles' split
    mlp = 3 * tokens * (f1 - f0) * e
    v0, v1 = split_range(args.vocab_size, tp, tp_rank)
    logits = batch * ((v1 - v0) + args.vocab_size) * 4 if last else 0
    return resid + max(attn, mlp, logits)
