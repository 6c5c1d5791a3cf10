"""The Triton kernels of a GPU's batch-1 decode step (imported only where one runs: it imports triton).

kernels/cuda_gemv.py, cuda_attention.py, cuda_attention_split.py and cuda_argmax.py launch them and say what each
computes. With PDL (programmatic dependent launch) a kernel may start while the one before it still runs: it reads
only weights (never written by a kernel) before `gdc_wait`, and everything else, and every store, after it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dependent_start(PDL: tl.constexpr):
    """Let the next kernel launch, then wait until the previous kernel's writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype` (to nearest, ties to even), kept in float32. bfloat16 rounds on the bits: written
    as casts, LLVM turns bfloat16 products followed by a bfloat16 sum into one fused multiply-add that skips the
    products' rounding (seen on an H200: the rotated keys differed from the module path's in a few elements). float16
    could fuse alike, so runtime/gpu_blocks.py keeps float16 caches off these kernels."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # the top 16 bits are the bfloat16
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # a NaN stays NaN (the add could carry it)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rope(ptr, offs, partner_offs, sign, cos, sin, ok, dtype: tl.constexpr):
    """x * cos + rotate_half(x) * sin at `offs`, each product and the sum rounded to `dtype` (models.llama.apply_rope
    in that dtype); `partner_offs` are the rotate_half partners, `sign` -1 on the first half."""
    x = tl.load(ptr + offs, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(ptr + partner_offs, mask=ok, other=0.0).to(tl.float32)
    return _rounded(_rounded(x * cos, dtype) + _rounded(sign * xp * sin, dtype), dtype).to(dtype)


@triton.jit
def _rotated_group(qkv_ptr, cos_ptr, sin_ptr, g, HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr,
                   HDP: tl.constexpr, REP: tl.constexpr, REPP: tl.constexpr, dtype: tl.constexpr):
    """From the joined q/k/v row: KV head g's rotated new key and its new value (HDP,), and its query heads, rotated
    (REPP, HDP; rows past REP and columns past HD are 0)."""
    d = tl.arange(0, HDP)
    dok = d < HD
    partner = tl.where(d < HD // 2, d + HD // 2, d - HD // 2)  # rotate_half: (-x[half:], x[:half])
    sign = tl.where(d < HD // 2, -1.0, 1.0)
    cos = tl.load(cos_ptr + d, mask=dok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + d, mask=dok, other=0.0).to(tl.float32)
    kbase = HQ * HD + g * HD
    k_new = _rope(qkv_ptr, kbase + d, kbase + partner, sign, cos, sin, dok, dtype)
    v_new = tl.load(qkv_ptr + (HQ + HKV) * HD + g * HD + d, mask=dok, other=0.0)
    r = tl.arange(0, REPP)
    qrows = (g * REP + r)[:, None] * HD  # (REPP, 1)
    q = _rope(qkv_ptr, qrows + d[None, :], qrows + partner[None, :], sign[None, :], cos[None, :], sin[None, :],
              (r < REP)[:, None] & dok[None, :], dtype)
    return k_new, v_new, q


@triton.jit
def _softmax_step(q, kt, vt, keep, top, total, acc, scale, dtype: tl.constexpr, IEEE: tl.constexpr):
    """One block of keys into an online softmax: scores q (R, D) x kt (B, D) under `keep` (B,); returns the running
    maximum (R,), sum of exponentials (R,) and unnormalized output (R, D), all float32."""
    if IEEE:  # float32: no tf32 rounding of the operands
        s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale  # (R, B)
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
    return new_top, total, acc


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, res_ptr, N, K, stride_w, eps,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr,
                RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """y = W @ f(x) (+ residual) for BLOCK_N rows of W a program (kernels/cuda_gemv.py)."""
    dtype = y_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    cols = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    tiles = w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :]  # (BLOCK_N, BLOCK_K) of the first tile
    w = tl.load(tiles, mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0)
    _dependent_start(PDL)
    scale = 1.0
    if NORM:
        squares = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            xv = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            squares += xv * xv
        scale = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # (rows, columns) partial products, summed at the end
    for k0 in tl.range(0, K, BLOCK_K):
        c = k0 + cols
        ok = c < K
        if SILU:
            gate = tl.load(x_ptr + c, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + c, mask=ok, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu, rounded to the dtype
            xv = (act * up).to(dtype).to(tl.float32)
        else:
            xv = tl.load(x_ptr + c, mask=ok, other=0.0).to(tl.float32)
            if NORM:
                nw = tl.load(nw_ptr + c, mask=ok, other=0.0).to(tl.float32)
                xv = ((xv * scale).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)
        current = w  # this tile; the next is loaded before its products are summed
        nxt = c + BLOCK_K
        w = tl.load(tiles + k0 + BLOCK_K, mask=(rows[:, None] < N) & (nxt[None, :] < K), other=0.0)
        acc += current.to(tl.float32) * xv[None, :]
    y = tl.sum(acc, 1)  # (BLOCK_N,)
    if RESIDUAL:
        r = tl.load(res_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        y = y.to(dtype).to(tl.float32) + r
    tl.store(y_ptr + rows, y.to(dtype), mask=rows < N)


@triton.jit
def _attend_keys(q, k_ptr, v_ptr, mask_ptr, g, slot, k_new, v_new, start, stop, L, stride_h, scale,
                 HD: tl.constexpr, HDP: tl.constexpr, REPP: tl.constexpr, BLOCK: tl.constexpr, dtype: tl.constexpr,
                 IEEE: tl.constexpr):
    """KV head g's query heads q (REPP, HDP) over cache slots [start, stop) under the mask, the step's slot taken
    from k_new, v_new (what this step writes there, so no program reads another's store): the online softmax's
    running maximum (REPP,), sum of exponentials (REPP,) and unnormalized output (REPP, HDP)."""
    d = tl.arange(0, HDP)
    dok = d < HD
    top = tl.full((REPP,), float("-inf"), tl.float32)
    total = tl.zeros((REPP,), tl.float32)
    acc = tl.zeros((REPP, HDP), tl.float32)
    for l0 in tl.range(start, stop, BLOCK):
        li = l0 + tl.arange(0, BLOCK)
        ok = (li < L)[:, None] & dok[None, :]
        tile = g * stride_h + li[:, None] * HD + d[None, :]  # (BLOCK, HDP)
        here = (li == slot)[:, None]
        kt = tl.where(here, k_new[None, :], tl.load(k_ptr + tile, mask=ok, other=0.0))
        vt = tl.where(here, v_new[None, :], tl.load(v_ptr + tile, mask=ok, other=0.0))
        keep = tl.load(mask_ptr + li, mask=li < L, other=0) != 0
        top, total, acc = _softmax_step(q, kt, vt, keep, top, total, acc, scale, dtype, IEEE)
    return top, total, acc


@triton.jit
def attention_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, mask_ptr, out_ptr, L, stride_h, scale,
                     HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, REP: tl.constexpr,
                     REPP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, IEEE: tl.constexpr):
    """One program a KV head: its new key and value into the cache, its query heads over every slot
    (kernels/cuda_attention.py)."""
    dtype = out_ptr.dtype.element_ty
    g = tl.program_id(0)
    _dependent_start(PDL)
    k_new, v_new, q = _rotated_group(qkv_ptr, cos_ptr, sin_ptr, g, HQ, HKV, HD, HDP, REP, REPP, dtype)
    slot = tl.load(slot_ptr)
    d = tl.arange(0, HDP)
    tl.store(k_ptr + g * stride_h + slot * HD + d, k_new, mask=d < HD)
    tl.store(v_ptr + g * stride_h + slot * HD + d, v_new, mask=d < HD)
    top, total, acc = _attend_keys(q, k_ptr, v_ptr, mask_ptr, g, slot, k_new, v_new, 0, L, L, stride_h, scale, HD,
                                   HDP, REPP, BLOCK, dtype, IEEE)
    r = tl.arange(0, REPP)
    out = tl.where(total[:, None] > 0, acc / total[:, None], 0.0)  # a row with every key masked gives 0
    tl.store(out_ptr + (g * REP + r)[:, None] * HD + d[None, :], out.to(dtype),
             mask=(r < REP)[:, None] & (d < HD)[None, :])


@triton.jit
def partial_kernel(qkv_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, mask_ptr, top_ptr, total_ptr, acc_ptr, L,
                   stride_h, scale, PER_SPLIT, HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr,
                   HDP: tl.constexpr, REP: tl.constexpr, REPP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                   IEEE: tl.constexpr):
    """Program (KV head, split): its query heads over the split's keys, as partial softmax results
    (kernels/cuda_attention_split.py); split 0 stores the new key and value."""
    dtype = k_ptr.dtype.element_ty
    g = tl.program_id(0)
    split = tl.program_id(1)
    _dependent_start(PDL)
    k_new, v_new, q = _rotated_group(qkv_ptr, cos_ptr, sin_ptr, g, HQ, HKV, HD, HDP, REP, REPP, dtype)
    slot = tl.load(slot_ptr)
    d = tl.arange(0, HDP)
    if split == 0:
        tl.store(k_ptr + g * stride_h + slot * HD + d, k_new, mask=d < HD)
        tl.store(v_ptr + g * stride_h + slot * HD + d, v_new, mask=d < HD)
    top, total, acc = _attend_keys(q, k_ptr, v_ptr, mask_ptr, g, slot, k_new, v_new, split * PER_SPLIT,
                                   (split + 1) * PER_SPLIT, L, stride_h, scale, HD, HDP, REPP, BLOCK, dtype, IEEE)
    r = tl.arange(0, REPP)
    part = (g * REP + r) * tl.num_programs(1) + split  # (REPP,): this program's rows of the partials
    tl.store(top_ptr + part, top, mask=r < REP)
    tl.store(total_ptr + part, total, mask=r < REP)
    tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=(r < REP)[:, None] & (d < HD)[None, :])


@triton.jit
def combine_kernel(top_ptr, total_ptr, acc_ptr, out_ptr, SPLITS: tl.constexpr, SP: tl.constexpr, HD: tl.constexpr,
                   HDP: tl.constexpr, PDL: tl.constexpr):
    """One program a query head: its splits' partials rescaled to a common maximum and added."""
    h = tl.program_id(0)
    _dependent_start(PDL)
    s = tl.arange(0, SP)
    sok = s < SPLITS
    d = tl.arange(0, HDP)
    tops = tl.load(top_ptr + h * SPLITS + s, mask=sok, other=float("-inf"))  # (SP,)
    best = tl.max(tops, 0)
    weights = tl.where(tops == float("-inf"), 0.0, tl.exp(tops - best))  # (SP,)
    totals = tl.load(total_ptr + h * SPLITS + s, mask=sok, other=0.0)
    accs = tl.load(acc_ptr + (h * SPLITS + s)[:, None] * HD + d[None, :], mask=sok[:, None] & (d < HD)[None, :],
                   other=0.0)  # (SP, HDP)
    total = tl.sum(totals * weights, 0)
    out = tl.where(total > 0, tl.sum(accs * weights[:, None], 0) / total, 0.0)
    tl.store(out_ptr + h * HD + d, out.to(out_ptr.dtype.element_ty), mask=d < HD)


@triton.jit
def _first_max(x, idx, ok, LIMIT):
    """(the maximum, NaN if any; the first index holding it, or the first NaN) of x over `ok`, as torch.argmax."""
    nan = (x != x) & ok
    key = tl.where(nan, float("inf"), tl.where(ok, x, float("-inf")))
    best = tl.max(key, 0)
    has_nan = tl.max(nan.to(tl.int32), 0) > 0
    hit = tl.where(has_nan, nan, (key == best) & ok)
    return tl.where(has_nan, float("nan"), best), tl.min(tl.where(hit, idx, LIMIT), 0)


@triton.jit
def chunk_kernel(x_ptr, value_ptr, index_ptr, V, stride_row, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, chunk): the chunk's first maximum and its index (kernels/cuda_argmax.py)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    _dependent_start(PDL)
    i = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_row + i, mask=i < V, other=float("-inf")).to(tl.float32)
    best, first = _first_max(x, i, i < V, V)
    tl.store(value_ptr + row * tl.num_programs(1) + chunk, best)
    tl.store(index_ptr + row * tl.num_programs(1) + chunk, first)


@triton.jit
def pick_kernel(value_ptr, index_ptr, out_ptr, CHUNKS: tl.constexpr, CP: tl.constexpr, PDL: tl.constexpr):
    """One program a row: the index held by the first chunk with the row's maximum."""
    row = tl.program_id(0)
    _dependent_start(PDL)
    c = tl.arange(0, CP)
    v = tl.load(value_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    idx = tl.load(index_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=0)
    _, first_chunk = _first_max(v, c, c < CHUNKS, CHUNKS)
    tl.store(out_ptr + row, tl.sum(tl.where(c == first_chunk, idx, 0), 0).to(tl.int64))
