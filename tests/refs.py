"""Reference outputs from transformers and the same outputs from shardlm ranks, for parity tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlm.engine.session import model_ref
from shardlm.models.source import ModelSource
from shardlm.parallel.context import ParallelContext
from shardlm.plan.plan import KVBudget, Plan
from shardlm.plan.run import RunFlags, plan_for_run
from shardlm.runtime.build import build_rank_model
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.rank_model import RankModel
from shardlm.settings import Settings
from shardlm.runtime.step import Batch, attention_mask, generate, positions_for


def plan_for(folder, **flags) -> tuple[Plan, ModelSource]:
    """The Plan `shardlm generate` would run for these flags (RunFlags fields) on `folder`, and the source."""
    source = ModelSource.open(folder)
    kv = flags.pop("kv", KVBudget(4, 128, 64))
    return plan_for_run(model_ref(source), source.family, source.args, RunFlags(**flags), kv), source


def build(folder, rank: int = 0, ctx: ParallelContext | None = None, device: str = "cpu",
          settings: Settings | None = None, offload_io: str = "mmap", **flags) -> RankModel:
    """Rank `rank`'s model of the plan for `flags`, built as a rank builds it (default context: one process)."""
    plan, source = plan_for(folder, device="cuda" if device.startswith("cuda") else "cpu", **flags)
    return build_rank_model(plan.rank_spec(rank), source, ctx or ParallelContext(), settings, device, offload_io)


@torch.no_grad()
def hf_logits_and_tokens(model, prompts: list[list[int]], n_new: int) -> tuple[torch.Tensor, list[list[int]]]:
    """transformers logits (b, s, vocab) over the left-padded batch and greedy continuations."""
    batch = Batch.from_lists(prompts)
    mask = batch.valid.long()
    logits = model(input_ids=batch.tokens, attention_mask=mask, position_ids=positions_for(batch.valid)).logits
    out = model.generate(input_ids=batch.tokens, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return logits.float(), out[:, batch.tokens.shape[1]:].tolist()


@torch.no_grad()
def shardlm_rank(rank: int, world: int, folder: str, prompts: list[list[int]], n_new: int, shm: bool):
    """On one rank: full logits over the padded batch and greedy continuations (no eos stop)."""
    coll = None
    if shm and world > 1:
        from shardlm.parallel.shm import ShmCollectives

        coll = ShmCollectives.from_group(dist.group.WORLD, 8 * 2**20, timeout_s=60)
    ctx = ParallelContext(rank=rank, world=world, shm=coll)
    model = build(folder, rank, ctx, tp=world)
    args = model.args
    batch = Batch.from_lists(prompts)
    s = batch.tokens.shape[1]
    logits = model(batch.tokens, positions_for(batch.valid), attention_mask(batch.valid, 0, s, args.sliding_window))
    tokens = generate(model, batch, n_new, SamplingParams(), ())
    if coll is not None:
        coll.close()
    return (logits if rank == 0 else None), tokens, ctx.snapshot()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor, rel: float = 1e-4) -> float:
    """Max abs difference over valid positions must be <= rel * max |ref logit|; returns the ratio."""
    diff = (ours - ref)[valid].abs().max().item()
    scale = ref[valid].abs().max().item()
    assert diff <= rel * scale, f"max |logit diff| {diff:.3g} > {rel} x max |logit| {scale:.3g}"
    return diff / scale


@torch.no_grad()
def shardlm_stage_rank(rank: int, world: int, folder: str, prompts: list[list[int]], n_new: int, tp: int,
                       counts: list[int], micro_batches: int, sampling: SamplingParams = SamplingParams(),
                       device: str = "cpu"):
    """On one rank of tp x len(counts) ranks: logits (last stage's rank 0 only), tokens and comms.
    `device` "cuda" puts every rank on GPU rank mod the GPUs (the group's backend as launched)."""
    from shardlm.parallel.context import PipePeers
    from shardlm.parallel.pipeline import pipeline_context
    from shardlm.runtime.pipeline_step import pipeline_generate, pipeline_logits

    nccl = dist.get_backend() == "nccl"
    plan, source = plan_for(folder, tp=tp, pp=len(counts), layers=tuple(counts) if len(counts) > 1 else None,
                            device="cuda" if device == "cuda" else "cpu")
    spec = plan.rank_spec(rank)
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    pipe = PipePeers(spec.stage, spec.pp, spec.prev, spec.next, spec.first, spec.last) if spec.pp > 1 else None
    ctx = pipeline_context(rank, spec.tp_groups, pipe, 0 if nccl else 8 * 2**20, timeout_s=60, nccl=nccl)
    model = build_rank_model(spec, source, ctx, None, device)
    args = model.args
    batch = Batch.from_lists(prompts)
    if ctx.pipe is None:
        s = batch.tokens.shape[1]
        inputs = (batch.tokens, positions_for(batch.valid), attention_mask(batch.valid, 0, s, args.sliding_window))
        logits = model(*(t.to(device) for t in inputs))
        tokens = generate(model, batch, n_new, sampling, ())
    else:
        logits = pipeline_logits(model.module, ctx, batch)
        tokens = pipeline_generate(model, ctx, batch, n_new, sampling, (), micro_batches)
    if ctx.shm is not None:
        ctx.shm.close()
    logits = logits.cpu() if logits is not None else None
    keep = logits is not None and ctx.rank == 0
    params = sorted(n for n, _ in model.module.named_parameters())
    return (logits if keep else None), tokens, ctx.snapshot(), params


def fused_block_inputs(dtype: torch.dtype, g: torch.Generator, rows: int, dim: int = 48, hq: int = 4, hkv: int = 2,
                       hd: int = 12) -> tuple:
    """Random inputs of a fused decode block (csrc/decode.h attn_decode) but its cache: x (rows, dim), the norm
    weight (dim,), the q, k, v, o weights, and cos, sin (rows, hd), all in `dtype`."""
    x, ln = torch.randn(rows, dim, generator=g).to(dtype), (torch.rand(dim, generator=g) + 0.5).to(dtype)
    ws = [(torch.randn(n, m, generator=g) / m ** 0.5).to(dtype)
          for n, m in ((hq * hd, dim), (hkv * hd, dim), (hkv * hd, dim), (dim, hq * hd))]
    angle = torch.rand(rows, hd // 2, generator=g) * 6
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))  # (rows, hd)
    return x, ln, ws, cos, sin


def blocks_of_32(x: torch.Tensor) -> torch.Tensor:
    """x (b, k) as the quantized kernels see it: each block of 32 rounded to int16 steps of its own scale,
    max|x| / 32767."""
    b, k = x.shape
    kp = -(-k // 32) * 32
    blocks = F.pad(x, (0, kp - k)).view(b, kp // 32, 32)  # (b, blocks, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    codes = torch.where(amax > 0, torch.round(blocks * (32767 / amax)), torch.zeros_like(blocks))
    return (codes * (amax / 32767)).view(b, kp)[:, :k]  # (b, k)


def block_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (b, blocks, 32) of float32 quantized as quantize_rows does: (codes (b, blocks, 32) int64, d (b, blocks)
    float32), d = max|x| / 32767 and codes round(x * (32767 / max|x|)) in float32, ties to even."""
    amax = blocks.abs().amax(-1)  # (b, blocks)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767).div(amax), torch.zeros_like(amax))  # one rounding
    # (a Python number over a tensor is the tensor's reciprocal times the number: two roundings)
    return torch.round(blocks * inv[..., None]).to(torch.int64), amax / 32767


def int8_weight(n: int, k: int, seed: int):
    """An Int8Weight of a random (n, k) float weight, from its own generator seeded `seed`."""
    from shardlm.quant import quantize_int8

    return quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


def assert_same_products(moved, plain, ext) -> None:
    """Two int8 weights of 600 input columns, one with its codes reordered (interleaved or paired), give the same
    matmul_t through the kernels (decode rows, and the panels for a prefill of two prompts of 100) and without them
    (torch's int8 kernel on natural codes), bit for bit."""
    g = torch.Generator().manual_seed(8)
    inputs = (torch.randn(1, 600, generator=g), torch.randn(3, 600, generator=g), torch.randn(2, 100, 600, generator=g))
    for x in inputs:
        for gemv in (ext, None):
            plain.gemv = moved.gemv = gemv
            assert torch.equal(moved.matmul_t(x), plain.matmul_t(x)), (x.shape, gemv)


def int8_exact_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """qrows.h's `exact` arithmetic, emulated: x (b, k) quantized per block of 32 as quantize_rows does (d = max|x| /
    32767, codes round(x * (32767 / max|x|)) in float32, ties to even), each block's integer sum of codes times
    weight codes, times d in float32, the terms added in float64, times the row's scale; (b, n) float32."""
    b, k = x.shape
    kp = q.shape[1]
    codes, d = block_codes(F.pad(x, (0, kp - k)).view(b, kp // 32, 32))  # (b, blocks, 32), (b, blocks)
    wq = q.to(torch.int64).view(q.shape[0], kp // 32, 32)  # (n, blocks, 32)
    isum = torch.einsum("jbc,rbc->jrb", codes, wq)  # (b, n, blocks), exact integers
    terms = (isum.float() * d[:, None, :]).double()  # float32 products, then float64
    return (terms.sum(-1) * scale.double()[None, :]).float()


def int4_exact_reference(x: torch.Tensor, qw) -> torch.Tensor:
    """q4tiles.h's `exact` int4 arithmetic, emulated (float64 (b, n), what `gemm_int4(..., exact=True, wide=True)`
    returns): x placed at the weight's padded columns and quantized per block of 32 as quantize_rows does; per
    (row, group) the integer sum of weight codes (0..15) times activation codes, times float32(scale * d) in float32,
    the terms added in float64; plus per group float32(zero - 8 * scale) times float32(d * the codes' sum), each product
    and their sum in float64."""
    codes_w, scale, zero = qw.codes()  # (n, kp) uint8, (n, groups) float32 each
    n, kp = codes_w.shape
    b = x.shape[0]
    padded = F.pad(x, (qw.pad_left, kp - qw.pad_left - x.shape[1])).view(b, kp // 32, 32)  # (b, groups, 32)
    codes, d = block_codes(padded)  # (b, groups, 32), (b, groups)
    xsum = d * codes.sum(-1).float()  # (b, groups) float32
    isum = torch.einsum("jgc,rgc->jrg", codes, codes_w.to(torch.int64).view(n, kp // 32, 32))  # (b, n, groups)
    f = scale[None] * d[:, None, :]  # (b, n, groups) float32
    terms = (isum.float() * f).double().sum(-1)
    m = zero - 8 * scale  # (n, groups) float32
    zterms = (m.double()[None] * xsum.double()[:, None, :]).sum(-1)
    return terms + zterms


def int8_float_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, units: str) -> torch.Tensor:
    """qrows.h's float-lane int8 arithmetic (weights no rank splits), emulated: x quantized as quantize_rows does;
    per pair and block, eight int32 lane sums (lane l: columns 2l, 2l + 1, 16 + 2l, 17 + 2l); AVX2: each block's lanes
    fused with its scale into one float32 chain; AVX-512 (csrc/qpairs.h): blocks 2c and 2c + 1 side by side as chunk
    c's sixteen lanes (an odd last block beside a zero block of scale 0), fused with their scales into chain c % 2, the
    two chains added at the end. Then the lanes added in order from zero, times the row's scale; (b, n) float32. The
    fused multiply-add is emulated in float64 (the product is exact)."""
    b, k = x.shape
    n, kp = q.shape
    nb = kp // 32
    codes, d = block_codes(F.pad(x, (0, kp - k)).view(b, nb, 32))  # (b, blocks, 32), (b, blocks)
    prod = torch.einsum("jbc,rbc->jrbc", codes, q.to(torch.int64).view(n, nb, 32))  # (b, n, blocks, 32)
    lanes = prod.view(b, n, nb, 2, 8, 2).sum((-3, -1))  # (b, n, blocks, 8): the column quads
    scales = d[:, None, :, None].expand(b, 1, nb, 8)  # (b, 1, blocks, 8)
    chains = 1
    if units.startswith("avx512"):
        lanes, scales = F.pad(lanes, (0, 0, 0, nb % 2)), F.pad(scales, (0, 0, 0, nb % 2))  # an even count of blocks
        lanes, scales = lanes.reshape(b, n, -1, 16), scales.reshape(b, 1, -1, 16)  # (b, n, chunks, 16)
        chains = 2
    acc = [torch.zeros(b, n, lanes.shape[-1]) for _ in range(chains)]
    for c in range(lanes.shape[2]):
        acc[c % chains] = (lanes[:, :, c].double() * scales[:, :, c].double() + acc[c % chains].double()).float()
    total = acc[0] + acc[1] if chains == 2 else acc[0]
    s = torch.zeros(b, n)
    for lane in range(total.shape[-1]):
        s = s + total[..., lane]
    return scale.float()[None, :] * s


def _flushed(t: torch.Tensor) -> torch.Tensor:
    """float32 values below the normal range as zero (VDPBF16PS's and VCVTNEPS2BF16's inputs)."""
    return torch.where(t.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(t), t)


def _fused_flushed(exact: torch.Tensor) -> torch.Tensor:
    """A VDPBF16PS step's float32 result from its exact (float64) value: rounded to 24 bits as if the exponent had no
    floor, then zero where that is below the normal range (a value just under 2^-126 that rounds up to it stays)."""
    scaled = torch.where(exact.abs() < 2.0 ** -100, (exact * 2.0 ** 100).float().double() * 2.0 ** -100, exact)
    return torch.where(scaled.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(scaled), scaled).float()


def bf16_dot_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The bfloat16 decode rows of avx512_bf16 builds (csrc/bf16dot.h), emulated: x (b, k) float32 rounded to
    bfloat16 (values below the normal range as zero), w (n, k) bfloat16; per output eight float32 chains, chain m at
    each step of 16 columns from i fusing w[i + 2m + 1] * x[i + 2m + 1] and then w[i + 2m] * x[i + 2m] (one rounding
    each, inputs and results below the normal range as zero), the chains added in order from zero, then the last
    k % 16 columns' products in order. Returns (b, n)."""
    k = x.shape[1]
    kk = k - k % 16
    xr = _flushed(x).bfloat16().float()
    xl = xr[:, :kk].double().reshape(x.shape[0], 1, kk // 16, 8, 2)  # (b, 1, steps, chains, (even, odd))
    wl = _flushed(w[:, :kk].float()).double().reshape(1, w.shape[0], kk // 16, 8, 2)
    acc = torch.zeros(x.shape[0], w.shape[0], 8)  # a bfloat16 product is exact in float64: one rounding, as an FMA
    for c in range(kk // 16):
        for col in (1, 0):
            acc = _fused_flushed(xl[:, :, c, :, col] * wl[:, :, c, :, col] + acc.double())
    s = torch.zeros(x.shape[0], w.shape[0])
    for lane in range(8):
        s = s + acc[:, :, lane]
    for t in range(kk, k):
        s = s + xr[:, None, t] * w[None, :, t].float()
    return s


def float_rows_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float kernels' documented arithmetic, emulated: eight float32 chains per output, each step one rounding
    per product (as an FMA), the chains added in order from zero, then the tail's rounded products in order. float32
    weights (rows.h): steps of 8 columns, chain l fusing w[i + l] * x[i + l]. bfloat16 weights (bf16rows.h, builds
    without avx512_bf16): steps of 16, chain m fusing w[i + 2m] * x[i + 2m], then w[i + 2m + 1] * x[i + 2m + 1].
    Returns (b, n) float32."""
    step = 16 if w.dtype == torch.bfloat16 else 8
    w, x = w.float(), x.float()
    k = w.shape[1]
    kk = k - k % step

    def terms(t: torch.Tensor) -> torch.Tensor:  # (rows, steps, terms, 8 chains)
        if step == 8:  # column i + l of a step is chain l's one term
            return t[:, :kk].double().reshape(t.shape[0], kk // 8, 1, 8)
        return t[:, :kk].double().reshape(t.shape[0], kk // 16, 8, 2).transpose(2, 3)  # columns 2m, 2m + 1: chain m

    wl, xl = terms(w), terms(x)
    acc = torch.zeros(x.shape[0], w.shape[0], 8)  # (b, n, 8) float32
    for c in range(kk // step):  # a float32 product is exact in float64: one rounding, as in an FMA
        for term in range(step // 8):
            acc = (xl[:, None, c, term, :] * wl[None, :, c, term, :] + acc.double()).float()
    s = torch.zeros(x.shape[0], w.shape[0])
    for lane in range(8):
        s = s + acc[:, :, lane]
    for t in range(kk, k):
        s = s + x[:, None, t] * w[None, :, t]
    return s


def exp_lanes_reference(x: torch.Tensor) -> torch.Tensor:
    """csrc/attend.h's exp_lanes on float32 values, step by step (each product and sum rounded on its own, as the
    build's contraction-off arithmetic): clamp to [-87, 88], x = n ln2 + r, the degree-6 polynomial, times 2^n."""
    f = torch.float32
    x = torch.where(x > 88.0, torch.tensor(88.0, dtype=f), x)
    x = torch.where(x < -87.0, torch.tensor(-87.0, dtype=f), x)
    fx = x * torch.tensor(1.44269504088896341, dtype=f) + torch.tensor(0.5, dtype=f)
    n = fx.to(torch.int32).to(f)  # truncation, then floor
    n = torch.where(n > fx, n - 1, n)
    x = x - n * torch.tensor(0.693359375, dtype=f)
    x = x - n * torch.tensor(-2.12194440e-4, dtype=f)
    p = torch.full_like(x, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * x + torch.tensor(c, dtype=f)
    p = p * (x * x) + x + torch.tensor(1.0, dtype=f)
    scale = ((n.to(torch.int32) + 127) << 23).view(f)  # 2^n, n in [-126, 127]
    return p * scale


def _pair_chain(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """VDPBF16PS steps over the last dimension of a and b (bfloat16 values as float32, pairs 2i, 2i + 1), into the
    float32 chains acc: each pair fuses the second's product, then the first's (inputs below the normal range zero)."""
    a, b = _flushed(a).double(), _flushed(b).double()
    for i in range(0, a.shape[-1], 2):
        for col in (i + 1, i):
            if col < a.shape[-1]:
                acc = _fused_flushed(a[..., col] * b[..., col] + acc.double())
    return acc


def prefill_pairs_reference(q, k, v, kv_map, mask) -> torch.Tensor:
    """The bfloat16 prefill attention of avx512_bf16 builds (csrc/prefill_dot.h, prefill_attn.h), emulated row by row:
    scores as VDPBF16PS chains over the head dimension's pairs; the softmax of softmax_row over the row's span of
    allowed keys (scaled, the max, exp_lanes, the sum in eight lanes from the span's first key, then the lanes in
    order, times 1 / sum); the weights rounded to bfloat16 and the values summed as VDPBF16PS chains over key pairs
    from the span's first key; the output rounded to bfloat16."""
    f = torch.float32
    b, hq, s, hd = q.shape
    out = torch.zeros(b, hq, s, hd, dtype=torch.bfloat16)
    scale = torch.tensor(1.0, dtype=f) / torch.sqrt(torch.tensor(float(hd), dtype=f))
    for j in range(b):
        for h in range(hq):
            keys, values = k[j, kv_map[h]].float(), v[j, kv_map[h]].float()
            for r in range(s):
                allowed = mask[j, 0, r]
                where = allowed.nonzero().flatten()
                lo, hi = int(where[0]), int(where[-1]) + 1
                ok = allowed[lo:hi]
                scores = _pair_chain(torch.zeros(hi - lo), q[j, h, r].float().expand(hi - lo, hd), keys[lo:hi])
                x = scores * scale
                top = x[ok].max()
                e = torch.where(ok, exp_lanes_reference(x - top), torch.zeros_like(x))
                n = hi - lo
                lanes = torch.zeros(8)
                for c in range(0, n, 8):
                    chunk = torch.zeros(8)
                    chunk[:min(8, n - c)] = e[c:c + 8]
                    lanes = lanes + chunk
                total = torch.zeros((), dtype=f)
                for lane in range(8):
                    total = total + lanes[lane]
                weights = _flushed(e * (torch.tensor(1.0, dtype=f) / total)).bfloat16().float()
                acc = _pair_chain(torch.zeros(hd), weights.expand(hd, n), values[lo:hi].T)
                out[j, h, r] = acc.bfloat16()
    return out
