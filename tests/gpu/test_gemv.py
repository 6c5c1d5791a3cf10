"""Triton GEMV decode blocks on a GPU (kernels/cuda_gemv.py, runtime/gpu_blocks.py; SHARDLM_CUDA_GEMV=1).

Skipped where torch sees no CUDA device (CI). The kernel is held to the module path's arithmetic with a float64
product; the blocks to the tokens of the graph path without them.
"""

from __future__ import annotations

import pytest
import torch

from refs import build
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.step import Batch, generate
from shardlm.settings import Settings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")

try:  # a kernel around kernels/triton_decode.py's bfloat16 rounding (Triton comes with CUDA builds of torch)
    import triton
    import triton.language as tl

    from shardlm.kernels.triton_decode import _rounded

    @triton.jit
    def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        tl.store(y_ptr + i, _rounded(tl.load(x_ptr + i, mask=ok, other=0.0), tl.bfloat16), mask=ok)
except ImportError:
    _round_kernel = None

CASES = [(n, k, shape) for n, k in [(160, 96), (333, 200), (2048, 2048)] for shape in [None, (16, 1024, 8)]]


def _assert_rounding_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what) -> None:
    """float32: within 2e-6 of the float64 reference; bfloat16: every element within one unit in the last place of
    the reference (plus 1e-5 for results near zero) and at least 90 % of them equal."""
    got, ref = got.double(), ref.double()
    assert not got.isnan().any(), what
    if dtype == torch.float32:
        assert ((got - ref).norm() / ref.norm()).item() < 2e-6, what
        return
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    assert ((got - ref).abs() <= ulp + 1e-5).all(), what
    assert (got == ref).double().mean().item() >= 0.9, what


@pytest.mark.parametrize("n,k,shape", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_is_the_module_paths_arithmetic(n, k, shape, dtype):
    """Every flag combination, odd widths, launch shapes wider than the weight and inputs small enough for eps to
    matter: the output is the module path's roundings around a float64 product, and every row is written."""
    from shardlm.kernels import cuda_gemv

    g = torch.Generator(device="cuda").manual_seed(n * k)
    for norm, silu, res in [(False, False, False), (True, False, False), (False, True, True), (True, False, True)]:
        for scale in (1.0, 1e-3):
            w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
            x = (scale * torch.randn(2 * k if silu else k, device="cuda", generator=g)).to(dtype)
            nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(dtype) if norm else None
            r = torch.randn(n, device="cuda", dtype=dtype, generator=g) if res else None
            out = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
            got = cuda_gemv.launch(x, w, nw, r, 1e-5, silu, out=out, shape=shape)
            _assert_rounding_close(got, cuda_gemv.reference(x, w, nw, r, 1e-5, silu), dtype, (norm, silu, res, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chained_launches_in_a_graph_give_the_lone_launches_results(dtype):
    """Three dependent GEMVs captured in one CUDA graph, with programmatic dependent launch and without, give the
    bits of the same launches run one by one outside a graph: each kernel reads what the one before it wrote."""
    from shardlm.kernels import cuda_gemv

    g = torch.Generator(device="cuda").manual_seed(11)
    w1, w2 = (torch.randn(n, 1024, device="cuda", generator=g).to(dtype) / 32 for n in (1024, 2048))
    w3 = torch.randn(1024, 1024, device="cuda", generator=g).to(dtype) / 32
    x = torch.randn(1024, device="cuda", generator=g).to(dtype)
    nw = torch.ones(1024, device="cuda", dtype=dtype)

    def chain(pdl):
        h = cuda_gemv.launch(x, w1, nw, x, 1e-5, False, pdl=pdl)  # (1024,): x + W1 norm(x)
        gu = cuda_gemv.launch(h, w2, nw, None, 1e-5, False, pdl=pdl)  # (2048,)
        return cuda_gemv.launch(gu, w3, None, h, 0.0, True, pdl=pdl)  # (1024,): h + W3 (silu(g) * u)

    want = chain(False)
    for pdl in (False, cuda_gemv.dependent_launch(x.device)):
        chain(pdl)  # compiles before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = chain(pdl)
        for _ in range(3):
            got.fill_(float("nan"))
            graph.replay()
            assert torch.equal(got, want), pdl


def test_gemv_refuses_a_wrong_input():
    """Inputs the kernel would misread are refused with what to pass instead."""
    from shardlm.kernels import cuda_gemv

    w = torch.randn(8, 16, device="cuda")
    x = torch.randn(16, device="cuda")
    with pytest.raises(ValueError, match="contiguous row of 32"):
        cuda_gemv.launch(x, w, None, None, 0.0, True)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        cuda_gemv.launch(torch.randn(8, device="cuda"), w.t(), None, None, 0.0, False)
    with pytest.raises(ValueError, match="contiguous row of 16"):
        cuda_gemv.launch(torch.randn(32, device="cuda")[::2], w, None, None, 0.0, False)
    with pytest.raises(ValueError, match="do not combine"):
        cuda_gemv.launch(torch.randn(32, device="cuda"), w, torch.ones(16, device="cuda"), None, 0.0, True)
    with pytest.raises(ValueError, match="residual of shape"):
        cuda_gemv.launch(x, w, None, torch.randn(16, device="cuda")[::2], 0.0, False)
    with pytest.raises(ValueError, match="out of shape"):
        cuda_gemv.launch(x, w, None, None, 0.0, False, out=torch.empty(8, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("compile", [False, True])
def test_gemv_blocks_give_the_graph_paths_tokens(random_dirs, compile, monkeypatch):
    """Batch-1 greedy decode through the GEMV blocks and their attention kernels (float32, odd widths), compiled
    or not, gives the tokens of the uncompiled graph path without them; a batch of two runs the module path (not
    compiled here: Inductor's autotuning of its products took over 95 s on an H200)."""
    folder = random_dirs["gqa12x4"]
    ran = _count_launches(monkeypatch)
    plain = build(folder, device="cuda:0", settings=Settings.from_env())
    model = build(folder, device="cuda:0", settings=Settings.from_env(cuda_compile=compile, cuda_gemv=True))
    assert model.kernels.gemv_layers == model.args.n_layers and plain.kernels.gemv_layers == 0
    assert "GEMV decode blocks in 3 layers" in model.kernels.describe()
    g = torch.Generator().manual_seed(3)
    for lengths in ([21], [7]) if compile else ([21], [7], [9, 4]):
        prompts = [torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist() for n in lengths]
        want = generate(plain, Batch.from_lists(prompts), 24, SamplingParams(), ())
        assert generate(model, Batch.from_lists(prompts), 24, SamplingParams(), ()) == want, lengths
    assert model.graphs.kept and all(d.graph is not None and not d.failed for d in model.graphs.kept.values())
    assert ran["gemv"] >= 4 * model.args.n_layers and ran["attention"] >= model.args.n_layers, ran


def _count_launches(monkeypatch) -> dict:
    """Counts of the GEMV and attention kernels' launches from here on (a silent fallback to the module path
    would leave them at 0)."""
    from shardlm.kernels import cuda_attention, cuda_gemv

    ran = {"gemv": 0, "attention": 0}
    for name, module in (("gemv", cuda_gemv), ("attention", cuda_attention)):
        def counted(*a, name=name, real=module.launch, **k):
            ran[name] += 1
            return real(*a, **k)
        monkeypatch.setattr(module, "launch", counted)
    return ran


@pytest.mark.parametrize("heads,kv_heads,hd,length,filled", [(32, 8, 64, 256, 168), (12, 4, 8, 64, 30),
                                                             (8, 2, 16, 130, 129), (5, 5, 32, 64, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [False, True])
def test_one_kernel_attention_is_rotary_the_cache_write_and_sdpa(heads, kv_heads, hd, length, filled, dtype, split,
                                                                  monkeypatch):
    """kernels/cuda_attention.py, one program a KV head or split over the keys, against the module path: the rotated
    key and the value land at the slot (equal bits), and the output matches SDPA over the masked cache."""
    from shardlm.kernels import cuda_attention
    from shardlm.models.llama import apply_rope, grouped_attention, rope_cos_sin

    monkeypatch.setattr(cuda_attention, "SPLIT", split)
    g = torch.Generator(device="cuda").manual_seed(length)
    qkv = torch.randn((heads + 2 * kv_heads) * hd, device="cuda", dtype=dtype, generator=g)
    caches = [torch.randn(1, kv_heads, length, hd, device="cuda", dtype=dtype, generator=g) for _ in range(2)]
    slot = torch.tensor([filled - 1], device="cuda")
    mask = torch.zeros(length, dtype=torch.bool, device="cuda")
    mask[:filled] = True
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
    cos, sin = rope_cos_sin(inv, torch.tensor([[filled + 3]], device="cuda"), dtype)  # (1, 1, 1, hd) each
    k_cache, v_cache = (c.clone() for c in caches)
    out = cuda_attention.launch(qkv, cos.view(-1), sin.view(-1), k_cache, v_cache, slot, mask, heads)
    q, k, v = qkv.view(1, 1, -1).split([heads * hd, kv_heads * hd, kv_heads * hd], -1)
    q = apply_rope(q.view(1, 1, heads, hd).transpose(1, 2), cos, sin)  # (1, hq, 1, hd)
    k = apply_rope(k.view(1, 1, kv_heads, hd).transpose(1, 2), cos, sin)  # (1, hkv, 1, hd)
    ref_k, ref_v = (c.clone() for c in caches)
    ref_k.index_copy_(2, slot, k)
    ref_v.index_copy_(2, slot, v.view(1, 1, kv_heads, hd).transpose(1, 2))
    kv_map = torch.arange(heads, device="cuda") // (heads // kv_heads)
    ref = grouped_attention(q.float(), ref_k.float(), ref_v.float(), kv_map, mask.view(1, 1, 1, -1), True)
    unchanged = torch.ones(length, dtype=torch.bool, device="cuda")
    unchanged[filled - 1] = False
    assert torch.equal(v_cache, ref_v) and torch.equal(k_cache[:, :, unchanged], ref_k[:, :, unchanged])
    if dtype == torch.bfloat16:  # rotary rounds as the module path does: the key's bits
        assert torch.equal(k_cache, ref_k)
    else:  # float32 products and sum may be fused into one rounding
        torch.testing.assert_close(k_cache, ref_k, rtol=1e-6, atol=1e-6)
    err = ((out.double() - ref.reshape(-1).double()).norm() / ref.double().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1.5e-2), err


@pytest.mark.parametrize("heads,kv_heads,hd,length,filled", [(32, 8, 64, 256, 168), (12, 4, 8, 64, 30),
                                                             (6, 2, 16, 1024, 700), (6, 2, 16, 1024, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_attention_is_the_one_pass_kernel(heads, kv_heads, hd, length, filled, dtype, monkeypatch):
    """kernels/cuda_attention_split.py against the one-program-a-KV-head kernel: the same cache writes (equal bits)
    and the same output within the dtype's rounding (the splits' sums are added in another order)."""
    from shardlm.kernels import cuda_attention

    g = torch.Generator(device="cuda").manual_seed(length + filled)
    qkv = torch.randn((heads + 2 * kv_heads) * hd, device="cuda", dtype=dtype, generator=g)
    cache = [torch.randn(1, kv_heads, length, hd, device="cuda", dtype=dtype, generator=g) for _ in range(2)]
    slot = torch.tensor([filled - 1], device="cuda")
    mask = torch.zeros(length, dtype=torch.bool, device="cuda")
    mask[:filled] = True
    cos, sin = torch.randn(hd, device="cuda", generator=g).to(dtype), torch.randn(hd, device="cuda", generator=g).to(dtype)
    outs, caches = [], []
    for split in (False, True):
        k_cache, v_cache = (c.clone() for c in cache)
        monkeypatch.setattr(cuda_attention, "SPLIT", split)
        outs.append(cuda_attention.launch(qkv, cos, sin, k_cache, v_cache, slot, mask, heads).double())
        caches.append((k_cache, v_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err


def test_greedy_argmax_is_torch_argmax():
    """kernels/cuda_argmax.py: torch.argmax's index (first maximum, first NaN, 0 for a row of -inf) on vocabularies
    that are not a multiple of its chunk, with many ties."""
    from shardlm.kernels import cuda_argmax

    g = torch.Generator(device="cuda").manual_seed(0)
    for case in range(40):
        rows, vocab = 1 + case % 3, [128256, 997, 2048, 5000, 1][case % 5]
        x = torch.randint(-4, 4, (rows, vocab), device="cuda", generator=g).float()
        if case % 4 == 1:
            x[0, torch.randint(0, vocab, (2,), device="cuda", generator=g)] = float("nan")
        if case % 6 == 2:
            x[-1] = float("-inf")
        if case % 7 == 3:
            x[0, torch.randint(0, vocab, (2,), device="cuda", generator=g)] = float("inf")
        got = cuda_argmax.greedy_pick(x[:, None])
        assert torch.equal(got, x.argmax(-1, keepdim=True)), case


def test_split_attention_and_greedy_argmax_keep_the_tokens(random_dirs, monkeypatch):
    """The GEMV blocks with their defaults, the split attention and the argmax kernel, give the graph path's greedy
    tokens (float32, uncompiled, a prompt past one split of keys)."""
    from shardlm.kernels import cuda_argmax, cuda_attention

    folder = random_dirs["gqa12x4"]
    plain = build(folder, device="cuda:0", settings=Settings.from_env())
    model = build(folder, device="cuda:0", settings=Settings.from_env(cuda_gemv=True))
    assert cuda_attention.SPLIT and model.graphs.model.greedy_pick is cuda_argmax.greedy_pick
    assert getattr(plain.graphs.model, "greedy_pick", None) is None
    picked = {"n": 0}
    real = cuda_argmax.launch

    def counted(*a, **k):
        picked["n"] += 1
        return real(*a, **k)
    monkeypatch.setattr(cuda_argmax, "launch", counted)
    g = torch.Generator().manual_seed(5)
    for n in (21, 90):
        prompt = [torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist()]
        want = generate(plain, Batch.from_lists(prompt), 40, SamplingParams(), ())
        assert generate(model, Batch.from_lists(prompt), 40, SamplingParams(), ()) == want, n
    assert picked["n"] >= 1  # captured once a graph


def test_bfloat16_rounding_on_the_bits_is_torchs():
    """kernels/triton_decode.py `_rounded`: float32 to bfloat16 (kept in float32) exactly as torch converts, over
    every kind of bit pattern: NaNs, infinities, ties to even, overflow to infinity, subnormals, random bits."""
    special = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800000, 0x3FFFFFFF, 0x7F7F8000, 0x7F7F7FFF, 1, 0x807FFFFF,
               0x3F808000, 0x3F818000, 0xBF808001, 0]
    g = torch.Generator().manual_seed(0)
    bits = torch.cat([torch.tensor(special, dtype=torch.int64), torch.randint(0, 2**32, (1 << 20,), generator=g)])
    x = bits.to(torch.int32).view(torch.float32).cuda()  # int64 -> int32 wraps: every 32-bit pattern reachable
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16).float()
    same = (y.view(torch.int32) == want.view(torch.int32)) | (y.isnan() & want.isnan())
    assert same.all(), x[~same][:8].tolist()
