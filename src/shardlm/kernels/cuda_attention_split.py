"""kernels/cuda_attention.py's decode attention split over the keys (flash-decoding): more programs, fewer keys each.

One program a KV head left 8 programs on a 132-multiprocessor H200 for Llama-3.2-1B, and the kernel took 7 us a layer
at 256 keys (bench/RESULTS.md, 2026-11-27 07:12). Here program (g, s) of a KV-head-by-split grid attends its group's
query heads over split s's keys and writes a partial result (the running maximum, the sum of exponentials and the
unnormalized output, float32); a second kernel, one program a query head, rescales the splits' partials to a common
maximum and adds them. Every program rotates the new key itself and uses it (and the new value) in place of the slot's
cache row, so no program reads what another writes; split 0 stores them in the cache.

Selected by `cuda_attention.SPLIT` (on by default; bench/gpu.py's gemv and compiled-gemv variants and their -sdpa
and -nopdl forms turn it off, the -split ones on).
"""

from __future__ import annotations

import torch

from shardlm.kernels.cuda_gemv import next_power_of_2

BLOCK_L = 64
"""Keys a loop step reads."""
PROGRAMS = 128
"""Programs the first kernel aims for (KV heads x splits), at least one block of keys a split."""


def _kernels():
    """The two Triton kernels (kernels/triton_decode.py, imported on first use)."""
    from shardlm.kernels.triton_decode import combine_kernel, partial_kernel

    return partial_kernel, combine_kernel


def splits_for(kv_heads: int, length: int) -> tuple[int, int]:
    """(splits, keys a split): about PROGRAMS programs, whole blocks of keys a split."""
    blocks = -(-length // BLOCK_L)
    splits = max(1, min(blocks, PROGRAMS // kv_heads))
    per_split = -(-blocks // splits) * BLOCK_L
    return -(-length // per_split), per_split


def launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot: torch.Tensor, mask: torch.Tensor, heads: int, pdl: bool) -> torch.Tensor:
    """As `cuda_attention.launch` (arguments checked there), in two kernels over splits of the keys."""
    partial, combine = _kernels()
    _, kv_heads, length, hd = k_cache.shape
    rep = heads // kv_heads
    splits, per_split = splits_for(kv_heads, length)
    top = torch.empty(heads * splits, dtype=torch.float32, device=qkv.device)
    total = torch.empty_like(top)
    acc = torch.empty(heads * splits, hd, dtype=torch.float32, device=qkv.device)
    out = torch.empty(heads * hd, dtype=qkv.dtype, device=qkv.device)
    extra = {"launch_pdl": True} if pdl else {}
    hdp = max(16, next_power_of_2(hd))
    partial[(kv_heads, splits)](qkv, cos, sin, k_cache, v_cache, slot, mask, top, total, acc, length, length * hd,
                                hd ** -0.5, per_split, HQ=heads, HKV=kv_heads, HD=hd, HDP=hdp, REP=rep,
                                REPP=max(16, next_power_of_2(rep)), BLOCK=BLOCK_L, PDL=pdl,
                                IEEE=qkv.dtype == torch.float32, num_warps=4, **extra)
    combine[(heads,)](top, total, acc, out, SPLITS=splits, SP=max(2, next_power_of_2(splits)), HD=hd, HDP=hdp,
                      PDL=pdl, num_warps=1, **extra)
    return out
