"""A batch-1 decode step's attention on a GPU as one Triton kernel: rotary, the cache write and attention together.

In a captured decode step of the module path, a layer's attention is several launches: rotary on q and k, the new
key and value copied into the cache at the step's slot, then SDPA over every slot under the mask (cuDNN's flash
kernel took 7 us a layer at 256 keys on an H200, bench/RESULTS.md 2026-11-26 23:00). Here one program a KV head
reads the joined q/k/v row the GEMV wrote, rotates its key and stores key and value at the slot (a device tensor, so
one graph serves every step), rotates its group's query heads, and attends over the cache's slots under the mask
with an online softmax, a block of keys at a time. Query heads of one KV head are the rows of one matrix product
(padded to 16), so K and V are read once per KV head.

Roundings follow the module path where it rounds to the dtype: the rotated key and query are rounded before use,
scores and the softmax are float32, and the probabilities are rounded to the dtype for the product with V, as
flash kernels do.
"""

from __future__ import annotations

import functools

import torch

BLOCK_L = 64
"""Keys a loop step reads."""


@functools.cache
def _kernel():
    """The Triton kernel, defined on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def attention_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, mask_ptr, out_ptr, L, stride_h, scale,
                         HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
                         REP: tl.constexpr, REPP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                         IEEE: tl.constexpr):
        dtype = out_ptr.dtype.element_ty
        g = tl.program_id(0)
        if PDL:  # nothing is read before the wait: the q/k/v row comes from the kernel before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        d = tl.arange(0, HDP)
        dok = d < HD
        half = HD // 2
        partner = tl.where(d < half, d + half, d - half)  # rotate_half: (-x[half:], x[:half])
        sign = tl.where(d < half, -1.0, 1.0)
        cos = tl.load(cos_ptr + d, mask=dok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + d, mask=dok, other=0.0).to(tl.float32)
        slot = tl.load(slot_ptr)
        kbase = HQ * HD + g * HD
        k = tl.load(qkv_ptr + kbase + d, mask=dok, other=0.0).to(tl.float32)
        k_partner = tl.load(qkv_ptr + kbase + partner, mask=dok, other=0.0).to(tl.float32)
        v = tl.load(qkv_ptr + (HQ + HKV) * HD + g * HD + d, mask=dok, other=0.0)
        tl.store(k_ptr + g * stride_h + slot * HD + d, (k * cos + sign * k_partner * sin).to(dtype), mask=dok)
        tl.store(v_ptr + g * stride_h + slot * HD + d, v, mask=dok)
        tl.debug_barrier()  # the new key and value are read back below by other threads of this program
        r = tl.arange(0, REPP)
        rok = r < REP
        qrows = (g * REP + r)[:, None] * HD  # (REPP, 1)
        both = rok[:, None] & dok[None, :]
        q = tl.load(qkv_ptr + qrows + d[None, :], mask=both, other=0.0).to(tl.float32)
        q_partner = tl.load(qkv_ptr + qrows + partner[None, :], mask=both, other=0.0).to(tl.float32)
        q = (q * cos[None, :] + sign[None, :] * q_partner * sin[None, :]).to(dtype)  # (REPP, HDP)
        top = tl.full((REPP,), float("-inf"), tl.float32)
        total = tl.zeros((REPP,), tl.float32)
        acc = tl.zeros((REPP, HDP), tl.float32)
        keys = tl.arange(0, BLOCK)
        for l0 in tl.range(0, L, BLOCK):
            li = l0 + keys
            lok = li < L
            tile = g * stride_h + li[:, None] * HD + d[None, :]  # (BLOCK, HDP)
            kt = tl.load(k_ptr + tile, mask=lok[:, None] & dok[None, :], other=0.0)
            vt = tl.load(v_ptr + tile, mask=lok[:, None] & dok[None, :], other=0.0)
            keep = tl.load(mask_ptr + li, mask=lok, other=0) != 0
            if IEEE:  # float32: no tf32 rounding of the operands
                s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale  # (REPP, BLOCK)
            else:
                s = tl.dot(q, tl.trans(kt)) * scale
            s = tl.where(keep[None, :], s, float("-inf"))
            new_top = tl.maximum(top, tl.max(s, 1))
            safe = tl.where(new_top == float("-inf"), 0.0, new_top)
            p = tl.exp(s - safe[:, None])
            alpha = tl.exp(top - safe)
            total = total * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(dtype), vt)
            top = new_top
        out = acc / total[:, None]
        tl.store(out_ptr + qrows + d[None, :], out.to(dtype), mask=both)

    return attention_kernel


def _p2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot: torch.Tensor, mask: torch.Tensor, heads: int, pdl: bool | None = None) -> torch.Tensor:
    """Attention of one decode row: qkv (hq*hd + 2*hkv*hd,) -> (hq*hd,), writing the rotated key and the value at
    `slot` (1,) of k_cache, v_cache (1, hkv, L, hd); cos, sin (hd,) hold the row's position; mask (L,) bool."""
    from shardlm.kernels.cuda_gemv import PDL, dependent_launch

    _, kv_heads, length, hd = k_cache.shape
    if heads % kv_heads or hd % 2 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"decode attention: {heads} query heads over {kv_heads} KV heads of {hd} (needs whole "
                         "groups, an even head size and contiguous caches)")
    out = torch.empty(heads * hd, dtype=qkv.dtype, device=qkv.device)
    rep = heads // kv_heads
    pdl = PDL and qkv.is_cuda and dependent_launch(qkv.device) if pdl is None else pdl
    extra = {"launch_pdl": True} if pdl else {}
    _kernel()[(kv_heads,)](qkv, cos, sin, k_cache, v_cache, slot, mask, out, length, length * hd, hd ** -0.5,
                           HQ=heads, HKV=kv_heads, HD=hd, HDP=max(16, _p2(hd)), REP=rep, REPP=max(16, _p2(rep)),
                           BLOCK=BLOCK_L, PDL=pdl, IEEE=qkv.dtype == torch.float32, num_warps=4, **extra)
    return out


@torch.library.custom_op("shardlm::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot: torch.Tensor, mask: torch.Tensor, heads: int) -> torch.Tensor:
    """One decode row's rotary, cache write and attention, one launch (see the module docstring)."""
    return launch(qkv, cos, sin, k_cache, v_cache, slot, mask, heads)


@decode_attention.register_fake
def _decode_attention_fake(qkv, cos, sin, k_cache, v_cache, slot, mask, heads):
    return qkv.new_empty(heads * k_cache.shape[-1])
