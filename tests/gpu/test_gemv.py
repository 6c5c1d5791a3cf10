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

CASES = [(n, k, shape) for n, k in [(160, 96), (333, 200), (2048, 2048)] for shape in [None, (16, 1024, 8)]]


@pytest.mark.parametrize("n,k,shape", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_is_the_module_paths_arithmetic(n, k, shape, dtype):
    """Every flag combination, odd widths and launch shapes wider than the weight: the output equals the module
    path's roundings around a float64 product within the dtype's rounding, and every row is written."""
    from shardlm.kernels import cuda_gemv

    g = torch.Generator(device="cuda").manual_seed(n * k)
    for norm, silu, res in [(False, False, False), (True, False, False), (False, True, True), (True, False, True)]:
        w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
        x = torch.randn(2 * k if silu else k, device="cuda", dtype=dtype, generator=g)
        nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(dtype) if norm else None
        r = torch.randn(n, device="cuda", dtype=dtype, generator=g) if res else None
        out = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
        got = cuda_gemv.launch(x, w, nw, r, 1e-5, silu, out=out, shape=shape).double()
        ref = cuda_gemv.reference(x, w, nw, r, 1e-5, silu).double()
        assert not got.isnan().any(), (norm, silu, res)
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < (2e-6 if dtype == torch.float32 else 8e-3), (norm, silu, res, err)


def test_gemv_refuses_a_wrong_input():
    from shardlm.kernels import cuda_gemv

    w = torch.randn(8, 16, device="cuda")
    with pytest.raises(ValueError, match="one row of 32"):
        cuda_gemv.launch(torch.randn(16, device="cuda"), w, None, None, 0.0, True)
    with pytest.raises(ValueError, match="contiguous"):
        cuda_gemv.launch(torch.randn(8, device="cuda"), w.t(), None, None, 0.0, False)


@pytest.mark.parametrize("compile", [False, True])
def test_gemv_blocks_give_the_graph_paths_tokens(random_dirs, compile):
    """Batch-1 greedy decode through the GEMV blocks and the one-kernel attention (float32, odd widths), compiled
    or not, gives the tokens of the uncompiled graph path without them; a batch of two runs the module path (not
    compiled here: Inductor's autotuning of its products took over 95 s on an H200)."""
    folder = random_dirs["gqa12x4"]
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


@pytest.mark.parametrize("heads,kv_heads,hd,length,filled", [(32, 8, 64, 256, 168), (12, 4, 8, 64, 30),
                                                             (8, 2, 16, 130, 129), (5, 5, 32, 64, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_kernel_attention_is_rotary_the_cache_write_and_sdpa(heads, kv_heads, hd, length, filled, dtype):
    """kernels/cuda_attention.py against the module path: the rotated key and the value land at the slot (equal
    bits), and the output matches SDPA over the masked cache."""
    from shardlm.kernels import cuda_attention
    from shardlm.models.llama import apply_rope, grouped_attention, rope_cos_sin

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
    # the key is rotated in float32 and rounded once (the module path rounds each of its three ops in bfloat16:
    # an H200 run saw up to 11 of 131072 elements differ, by up to 0.002, where the terms nearly cancel)
    raw = qkv[heads * hd:(heads + kv_heads) * hd].view(kv_heads, hd).float()
    rotated = torch.cat((-raw[:, hd // 2:], raw[:, :hd // 2]), dim=-1)
    once = (raw * cos.view(-1).float() + rotated * sin.view(-1).float()).to(dtype)  # (hkv, hd)
    torch.testing.assert_close(k_cache[0, :, filled - 1], once, rtol=1e-5 if dtype == torch.float32 else 8e-3,
                               atol=1e-5)
    err = ((out.double() - ref.reshape(-1).double()).norm() / ref.double().norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1.5e-2), err
