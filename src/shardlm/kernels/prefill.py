"""A float32 CPU prefill block with its element-wise work compiled (csrc/prefill_ops.h).

A prefill pass is bound by its products (the panels of csrc/qgemm.h and csrc/qpanel.h), but the module path also ran ~20 torch ops a
block around them: on a 512-token pass of the bundled model they took 67 of 306 ms (torch.profiler), the rotary
multiplies on transposed views above all. `FusedPrefill`, installed as each block's `prefill_step` where the
compiled kernels are chosen and the model is float32, runs the same block with the products, the cache write and
the attention as the modules do them (any weight form, tensor-parallel or not: the projections are still the
block's modules, so a row-parallel o or down projection all-reduces inside its own forward) and everything else in
one compiled pass each: the input norm, the rotation of q and k (which also lays them out by head), the residual add
with the second norm, and silu(gate) * up.

Numbers: the rotation and the adds round as the module path does (same bits); the norms and the gating are the
fused decode kernels' (csrc/rows.h, csrc/attend.h), which round differently from torch's rms_norm and silu in the
last bits, as the fused decode step already does. Each value is computed alike whatever the rows beside it, so a
token's result does not depend on the batch or the chunk around it.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedPrefill:
    """The prefill step of one float32 block, installed as `layer.prefill_step` (models/llama.py)."""

    def __init__(self, ops):
        self.ops = ops

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        """A pass of several positions a row (a prefill) of float32 CPU hidden states. (The block also needs its
        compiled prefill attention, `Attention.prefill_attention`; without it the modules run.)"""
        return x.dim() == 3 and x.shape[1] > 1 and x.dtype == torch.float32 and x.device.type == "cpu"

    def __call__(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 cache) -> torch.Tensor | None:
        """One block for a prefill pass: x (b, s, dim) -> (b, s, dim), writing the layer's cache; None when the call
        does not apply (the block then runs module by module). Arguments as DecoderLayer.forward takes them."""
        ops, attn, mlp = self.ops, layer.self_attn, layer.mlp
        if not self.applies(x) or cos.dtype != torch.float32 or attn.prefill_attention is None:
            return None
        b, s, _ = x.shape
        hd = attn.head_dim
        x = x.contiguous()
        norm = layer.input_layernorm
        _, xn = ops.prefill_norm(x, None, norm.weight, norm.eps)  # (b, s, dim)
        q = ops.rope_heads(attn.q_proj(xn), cos, sin, hd)  # (b, hq, s, hd)
        k = ops.rope_heads(attn.k_proj(xn), cos, sin, hd)  # (b, hkv, s, hd)
        v = attn.v_proj(xn).view(b, s, -1, hd).transpose(1, 2)  # (b, hkv, s, hd)
        if cache is not None:
            k, v = cache.update(attn.layer_id, k, v)  # (b, hkv, t, hd)
        out = attn.prefill_attention(q, k.contiguous(), v.contiguous(), attn.kv_map,
                                    mask.expand(b, 1, s, k.shape[2]).contiguous())  # (b, hq, s, hd)
        out = attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))  # (b, s, dim)
        norm = layer.post_attention_layernorm
        h, hn = ops.prefill_norm(out.contiguous(), x, norm.weight, norm.eps)  # h = x + attention; hn its norm
        act = ops.silu_mul_(mlp.up_proj(hn).contiguous(), mlp.gate_proj(hn).contiguous())  # (b, s, inter)
        return h.add_(mlp.down_proj(act))


def install_prefill(model: nn.Module, ops, dtype: torch.dtype) -> int:
    """Give every block of a float32 `model` a FusedPrefill step; returns how many blocks got one (0 when `ops` is
    None, lacks the prefill kernels (an older build) or `dtype` is not float32)."""
    if ops is None or dtype != torch.float32 or not hasattr(ops, "rope_heads"):
        return 0
    step = FusedPrefill(ops)
    layers = list(model.model.layers.values())
    for layer in layers:
        layer.prefill_step = step
    return len(layers)
