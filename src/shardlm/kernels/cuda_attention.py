"""A batch-1 decode step's attention on a GPU in Triton: rotary, the cache write and attention together, as one kernel
here or, by default (`SPLIT`), split over the keys in two (kernels/cuda_attention_split.py).

In a captured decode step of the module path, a layer's attention is several launches: rotary on q and k, the new
key and value copied into the cache at the step's slot, then SDPA over every slot under the mask (cuDNN's flash
kernel took 7 us a layer at 256 keys on an H200, bench/RESULTS.md 2026-11-26 23:00). Here one program a KV head
reads the joined q/k/v row the GEMV wrote, rotates its key and stores key and value at the slot (a device tensor, so
one graph serves every step), rotates its group's query heads, and attends over the cache's slots under the mask
with an online softmax, a block of keys at a time. Query heads of one KV head are the rows of one matrix product
(padded to 16), so K and V are read once per KV head.

Roundings follow the module path where it rounds to the dtype: rotary rounds each product and their sum (so the key
written to the cache has the module path's bits), scores and the softmax are float32, and the probabilities are
rounded to the dtype for the product with V, as flash kernels do. A row whose keys are all masked gives 0.
"""

from __future__ import annotations

import torch

from shardlm.kernels.cuda_gemv import next_power_of_2

BLOCK_L = 64
"""Keys a loop step reads."""
SPLIT = True
"""Run kernels/cuda_attention_split.py's two kernels over splits of the keys (the default: on an H200 they took a
Llama-3.2-1B compiled GEMV step from 1089.7 to 1182.0 tok/s, bench/RESULTS.md 2026-11-27 16:40); False: this module's
one program a KV head."""


def _kernel():
    """The Triton kernel (kernels/triton_decode.py, imported on first use)."""
    from shardlm.kernels.triton_decode import attention_kernel

    return attention_kernel


def launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot: torch.Tensor, mask: torch.Tensor, heads: int, pdl: bool | None = None) -> torch.Tensor:
    """Attention of one decode row: qkv (hq*hd + 2*hkv*hd,) -> (hq*hd,), writing the rotated key and the value at
    `slot` (1,) of k_cache, v_cache (1, hkv, L, hd); cos, sin (hd,) hold the row's position; mask (L,) bool."""
    from shardlm.kernels.cuda_gemv import PDL, dependent_launch

    check_inputs(qkv, cos, sin, k_cache, v_cache, slot, mask, heads)
    _, kv_heads, length, hd = k_cache.shape
    pdl = PDL and qkv.is_cuda and dependent_launch(qkv.device) if pdl is None else pdl
    if SPLIT:
        from shardlm.kernels.cuda_attention_split import launch as split_launch

        return split_launch(qkv, cos, sin, k_cache, v_cache, slot, mask, heads, pdl)
    out = torch.empty(heads * hd, dtype=qkv.dtype, device=qkv.device)
    rep = heads // kv_heads
    extra = {"launch_pdl": True} if pdl else {}
    _kernel()[(kv_heads,)](qkv, cos, sin, k_cache, v_cache, slot, mask, out, length, length * hd, hd ** -0.5,
                           HQ=heads, HKV=kv_heads, HD=hd, HDP=max(16, next_power_of_2(hd)), REP=rep,
                           REPP=max(16, next_power_of_2(rep)),
                           BLOCK=BLOCK_L, PDL=pdl, IEEE=qkv.dtype == torch.float32, num_warps=4, **extra)
    return out


def check_inputs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot: torch.Tensor, mask: torch.Tensor, heads: int) -> None:
    """ValueError naming what the kernels would misread: whole query groups, an even head size, one row's caches,
    contiguous vectors of the right sizes."""
    rows, kv_heads, length, hd = k_cache.shape
    if heads % kv_heads or hd % 2 or rows != 1 or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode attention: {heads} query heads over caches of shape {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}; needs one row, whole query groups and an even head size")
    wanted = {"qkv": (qkv, (heads + 2 * kv_heads) * hd), "cos": (cos, hd), "sin": (sin, hd), "slot": (slot, 1),
              "mask": (mask, length)}
    for name, (t, size) in wanted.items():
        if t.shape != (size,) or t.stride(0) != 1:
            raise ValueError(f"decode attention: {name} of shape {tuple(t.shape)}; pass a contiguous ({size},) tensor")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode attention: the caches must be contiguous")


@torch.library.custom_op("shardlm::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot: torch.Tensor, mask: torch.Tensor, heads: int) -> torch.Tensor:
    """One decode row's rotary, cache write and attention, one launch or two with `SPLIT` (see the module
    docstring)."""
    return launch(qkv, cos, sin, k_cache, v_cache, slot, mask, heads)


@decode_attention.register_fake
def _decode_attention_fake(qkv, cos, sin, k_cache, v_cache, slot, mask, heads):
    """The output's shape and dtype, for tracing."""
    return qkv.new_empty(heads * k_cache.shape[-1])
