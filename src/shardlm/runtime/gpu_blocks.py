"""A one-GPU rank's batch-1 decode block as four GEMV launches (SHARDLM_CUDA_GEMV=1; kernels/cuda_gemv.py).

The module path of a decoder block at one row launches, besides attention: the input norm, the joined q/k/v
product, the o product, the residual add, the second norm, the joined gate/up product, the gating, the down product
and the second residual add. Here the norms ride in the products that read them, the gating in the down product and
the residual adds in the products before them, and attention is one operation:

    qkv = gemv(x, W_qkv, norm=input_layernorm)            (n_qkv,)
    out = attention(qkv)                                   (hq*hd,): rotary, the cache write and attention over
                                                           splits of the keys in two kernels
                                                           (kernels/cuda_attention_split.py, through
                                                           kernels/cuda_attention.py) in a captured step
    h   = gemv(out, W_o, residual=x)                       (dim,)
    gu  = gemv(h, W_gate_up, norm=post_attention_layernorm)  (2 * inter,)
    y   = gemv(gu, W_down, silu=True, residual=h)          (dim,)

Installed as `DecoderLayer.decode_step` where it applies (plain joined bias-free weights, tp 1 and pp 1); other
calls (prefill, more than one row, the serving engine's slot caches) return None and run the module path. Serving
stays on the module path because its rows are the first slots, a power of two covering the decoding ones: a request
alone in slot 0 would run these kernels, and beside others cuBLAS, so its tokens would depend on its neighbours.
Where a layer takes the blocks, every graph replay of the model picks its greedy token with kernels/cuda_argmax.py
(`greedy_pick`), at any batch size.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.runtime.kvcache import KVCache


def eligible(layer: nn.Module) -> bool:
    """Joined q/k/v and gate/up, plain bias-free float o and down products with contiguous rows, on a GPU."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qkv_weight is None or mlp.gate_up_weight is None or attn.qkv_bias is not None:
        return False
    if mlp.gate_up_bias is not None or type(attn.o_proj) is not nn.Linear or type(mlp.down_proj) is not nn.Linear:
        return False
    weights = (attn.qkv_weight, attn.o_proj.weight, mlp.gate_up_weight, mlp.down_proj.weight)
    return (attn.o_proj.bias is None and mlp.down_proj.bias is None and all(w.is_cuda and w.stride(1) == 1
            and w.dtype in (torch.float32, torch.bfloat16, torch.float16) for w in weights))


def gemv_block(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
               cache) -> torch.Tensor | None:
    """One decode row through the block (x (1, 1, dim) -> (1, 1, dim)); None for any other shape."""
    b, s, dim = x.shape
    if b != 1 or s != 1 or not x.is_contiguous() or not isinstance(cache, KVCache):
        return None  # serving's slot caches keep the module path: a row's products must not depend on its slot
    gemv = torch.ops.shardlm.gemv
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    row = x.view(dim)
    qkv = gemv(row, attn.qkv_weight, norm1.weight, None, norm1.eps, False)  # (n_qkv,)
    if layer.gemv_attention and one_kernel_attention(attn, cache, mask, cos):
        out = torch.ops.shardlm.decode_attention(qkv, cos.view(-1), sin.view(-1), cache.k[attn.layer_id],
                                                 cache.v[attn.layer_id], cache.slot, mask.view(-1),
                                                 attn.qkv_split[0] // attn.head_dim)  # (hq*hd,)
    else:
        q, k, v = qkv.view(1, 1, -1).split(attn.qkv_split, dim=-1)  # (1, 1, h*hd) each
        out = attn.attend(q, k, v, cos, sin, mask, cache).view(-1)  # (hq*hd,)
    h = gemv(out, attn.o_proj.weight, None, row, 0.0, False)  # (dim,): x + o(out)
    gate_up = gemv(h, mlp.gate_up_weight, norm2.weight, None, norm2.eps, False)  # (2 * inter,)
    y = gemv(gate_up, mlp.down_proj.weight, None, h, 0.0, True)  # (dim,): h + down(silu(gate) * up)
    return y.view(1, 1, dim)


def one_kernel_attention(attn: nn.Module, cache, mask: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the step's attention can run as kernels/cuda_attention.py's kernels: a captured step's cache (its slot
    on the device) in float32 or bfloat16, regular query groups, one mask row over the cache's slots, at most MAX_KEYS
    of them. float16 keeps the module path's attention: its rotary roundings could be fused into one FMA, as
    bfloat16's were until they moved onto the bits (kernels/triton_decode.py `_rounded`), and no GPU has run it."""
    if not isinstance(cache, KVCache) or cache.slot is None or not attn.regular_gqa:
        return False
    keys = cache.k[attn.layer_id]
    return (keys.shape[0] == 1 and keys.shape[2] <= MAX_KEYS and mask.numel() == keys.shape[2]
            and cos.numel() == attn.head_dim and keys.is_contiguous() and keys.dtype in (torch.float32, torch.bfloat16))


MAX_KEYS = 8192
"""Longest cache the decode attention kernels read (the attention tests' longest is 1024 keys); longer ones take
SDPA."""


def install_gemv_blocks(model: nn.Module, attention: bool = True) -> int:
    """Put `gemv_block` in every eligible decoder layer of `model`, with the decode attention kernels where they apply
    (`attention`), and, where any layer took it, kernels/cuda_argmax.py as the graph path's greedy pick for every
    replay of the model (torch.argmax's index in two launches); returns how many layers."""
    import shardlm.kernels.cuda_attention  # noqa: F401 - registers torch.ops.shardlm.decode_attention
    import shardlm.kernels.cuda_gemv  # noqa: F401 - registers torch.ops.shardlm.gemv
    from shardlm.kernels.cuda_argmax import greedy_pick

    taken = 0
    for layer in model.model.layers.values():
        if layer.decode_step is None and eligible(layer):
            layer.decode_step = gemv_block
            layer.gemv_attention = attention
            taken += 1
    if taken:
        model.greedy_pick = greedy_pick  # runtime/cuda_graph.py decode_step: the token a replay feeds the next
    return taken
