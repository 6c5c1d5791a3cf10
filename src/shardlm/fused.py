"""Fused CPU decode of a Llama block: each half of the block in one compiled call (csrc/decode.h).

A block decoding one new token per row used to run ~45 small torch ops; at batch 1 their dispatch
cost about as much as streaming the weights. When the compiled kernels are active ("gemv" mode),
the model is float32 or bfloat16 on CPU and the block's seven linear weights are plain (not quantized, not
oneDNN-packed), `decode_layer` runs the block as two calls: the attention half (norm, q/k/v,
rotary, cache write, attention, o projection) and the MLP half (norm, gate/up, SiLU gating, down
projection). On one rank each call also adds the residual; under tensor parallelism the o and down
projections are row-parallel (`RowParallelLinear`), so each call returns this rank's partial sums
and the all-reduce, the bias and the residual follow here. Offloaded layers work unchanged (their
hooks bring the weights in around the block's forward). In bfloat16 the arithmetic inside
each call is float32 and only the cache and each half's output are rounded to bfloat16 (the module
path rounds after every op), so the two paths differ by bfloat16 rounding, not more. Everything
else (prefill, float16, quantized weights, CUDA) takes the module-by-module path, which is also the reference the fused
path is tested against. SHARDLM_FUSED=0 turns it off.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from shardlm import kernels
from shardlm.runtime.kvcache import KVCache

ENABLED = os.environ.get("SHARDLM_FUSED", "1") != "0"
"""False when SHARDLM_FUSED=0; the compiled kernels must also be active (see `ready`)."""


DTYPES = (torch.float32, torch.bfloat16)
"""Model dtypes the fused step runs (arithmetic in float32; cache and outputs in the model's dtype)."""


def _plain(linear: nn.Module, dtype: torch.dtype) -> bool:
    """A linear whose weight (of `dtype`) can be read directly (no quantized, packed or streamed-head form)."""
    d = linear.__dict__
    weight = getattr(linear, "weight", None)
    return d.get("quant") is None and d.get("row_stream") is None and getattr(linear, "packed", None) is None \
        and weight is not None and weight.dtype == dtype


def ready(layer: nn.Module, x: torch.Tensor, mask: torch.Tensor, cache: KVCache | None) -> bool:
    """Whether `decode_layer` can run this block on `x` (b, 1, dim) with this mask and cache."""
    if not ENABLED or cache is None or x.shape[1] != 1 or kernels._ACTIVE is None or x.dtype not in DTYPES \
            or x.device.type != "cpu" or x.shape[0] > kernels.GEMV_MAX_ROWS or mask.dtype != torch.bool \
            or mask.shape[-1] != cache.offset + 1:
        return False
    known = layer.__dict__.setdefault("_fused_ok", {})  # dtype -> bool: the block's structure does not
    ok = known.get(x.dtype)                             # change after loading, so decide once
    if ok is None:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        ok = known[x.dtype] = all(_plain(m, x.dtype) for m in linears) \
            and layer.input_layernorm.weight.dtype == layer.post_attention_layernorm.weight.dtype == x.dtype
    return ok


def _finish(x: torch.Tensor, partial: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """x + all_reduce(partial) + bias, for a row-parallel projection's partial sums (b, dim)."""
    y = proj.ctx.all_reduce(partial).add_(x)
    return y.add_(proj.bias) if proj.bias is not None else y


def decode_layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 cache: KVCache) -> torch.Tensor:
    """One block for one new token per row: x (b, 1, dim) -> (b, 1, dim); writes the layer's cache slot.

    cos/sin (b, 1, 1, hd) and mask (b, 1, 1, offset+1) as the module path takes them.
    """
    ops = kernels._ACTIVE
    attn, mlp = layer.self_attn, layer.mlp
    b, _, dim = x.shape
    cache.check_room(1)
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    o_split = hasattr(o, "ctx")  # row-parallel: partial sums to all-reduce
    norm = layer.input_layernorm
    x = x.reshape(b, dim)
    h = ops.attn_decode(x, norm.weight, norm.eps, q.weight, k.weight, v.weight, q.bias, k.bias, v.bias,
                        cos.reshape(b, -1), sin.reshape(b, -1), cache.k[attn.layer_id], cache.v[attn.layer_id],
                        cache.offset, attn.kv_map, mask.reshape(b, -1), o.weight, o.bias, not o_split)  # (b, dim)
    if o_split:
        h = _finish(x, h, o)
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    down_split = hasattr(down, "ctx")
    norm = layer.post_attention_layernorm
    out = ops.mlp_decode(h, norm.weight, norm.eps, gate.weight, up.weight, gate.bias, up.bias, down.weight, down.bias,
                         not down_split)  # (b, dim)
    if down_split:
        out = _finish(h, out, down)
    return out.view(b, 1, dim)
