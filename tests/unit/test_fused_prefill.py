"""The fused float32 prefill block (shardlm.kernels.prefill, csrc/prefill_ops.h) against torch and the module path.

The rotation equals apply_rope bit for bit; the norm and the gating are decode's (within float32 rounding of
torch's); every kernel gives a row the same bits alone and in any batch; a model's prefill through the fused blocks
stays within float32 rounding of the module path on every awkward random model, dense and quantized, and keeps a
prompt's logits its own beside other prompts."""

import pytest
import torch
import torch.nn.functional as F

from conftest import RANDOM_MODELS
from refs import build
from shardlm.kernels.prefill import FusedPrefill
from shardlm.models.llama import apply_rope, rope_cos_sin
from shardlm.runtime.step import Batch, Rows
from shardlm.settings import Settings


@pytest.fixture(scope="module")
def ext(kernel_ext):
    return kernel_ext


@pytest.mark.parametrize("b,s,heads,hd", [(1, 2, 1, 2), (3, 17, 5, 64), (2, 9, 12, 16), (1, 33, 3, 10)])
def test_rope_heads_equals_apply_rope_bit_for_bit(b, s, heads, hd, ext):
    g = torch.Generator().manual_seed(b * s + heads)
    x = torch.randn(b, s, heads * hd, generator=g) * 3
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))  # (hd / 2,)
    positions = torch.randint(0, 500, (b, s), generator=g)
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)  # (b, 1, s, hd)
    want = apply_rope(x.view(b, s, heads, hd).transpose(1, 2), cos, sin)  # (b, heads, s, hd)
    got = ext.rope_heads(x, cos, sin, hd)
    assert got.shape == (b, heads, s, hd) and got.is_contiguous()
    assert torch.equal(got, want)


@pytest.mark.parametrize("d", [7, 64, 576, 1001])
def test_prefill_norm_and_residual(d, ext):
    g = torch.Generator().manual_seed(d)
    x, r = torch.randn(37, d, generator=g), torch.randn(37, d, generator=g)
    w = 1 + 0.1 * torch.randn(d, generator=g)
    h, out = ext.prefill_norm(x, r, w, 1e-5)
    assert torch.equal(h, x + r)
    want = w.double() * F.rms_norm(h.double(), (d,), eps=1e-5)
    assert (out.double() - want).abs().max() <= 1e-6 * want.abs().max()
    same, alone = ext.prefill_norm(x, None, w, 1e-5)
    assert same.data_ptr() == x.data_ptr()
    for j in (0, 5, 36):  # a row alone gives the bits it gets in the batch
        assert torch.equal(ext.prefill_norm(x[j:j + 1], None, w, 1e-5)[1], alone[j:j + 1])
        assert torch.equal(ext.prefill_norm(x[j:j + 1], r[j:j + 1], w, 1e-5)[1], out[j:j + 1])


@pytest.mark.parametrize("n", [1, 15, 16, 17, 200, 1536])
def test_silu_mul_in_place(n, ext):
    g = torch.Generator().manual_seed(n)
    gate, up = torch.randn(9, n, generator=g) * 6, torch.randn(9, n, generator=g)
    want = F.silu(gate.double()) * up.double()
    got = up.clone()
    assert ext.silu_mul_(got, gate).data_ptr() == got.data_ptr()
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
    row = up[4:5].clone()
    assert torch.equal(ext.silu_mul_(row, gate[4:5]), got[4:5])


def test_prefill_kernels_refuse_bad_inputs(ext):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="norm weight has 7 values"):
        ext.prefill_norm(x, None, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        ext.prefill_norm(x.double(), None, torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="heads"):
        ext.rope_heads(torch.randn(1, 3, 10), torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4), 4)
    with pytest.raises(RuntimeError, match="differ"):
        ext.silu_mul_(torch.randn(2, 4), torch.randn(2, 5))


def _logits(rank, prompts, fused: bool):
    """Prefill logits (b, s, vocab) of left-padded prompts, through the fused blocks or the modules."""
    layers = list(rank.module.model.layers.values())
    saved = [layer.prefill_step for layer in layers]
    calls = []
    for layer, step in zip(layers, saved):
        layer.prefill_step = (lambda *a, step=step: calls.append(1) or step(*a)) if fused else None
    try:
        batch = Batch.from_lists(prompts)
        rows = Rows.for_model(rank, batch, 2)
        return rows.forward(rank.module, batch.tokens, rows.prefill_mask()), len(calls)
    finally:
        for layer, step in zip(layers, saved):
            layer.prefill_step = step


def _prompts(vocab, lengths=(19, 7, 12)):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@torch.no_grad()
def test_fused_prefill_matches_modules(name, quantization, random_dirs):
    rank = build(random_dirs[name], settings=Settings(kernels="gemv"), dtype="float32", quantization=quantization)
    assert rank.kernels.prefill_layers == rank.args.n_layers
    assert all(isinstance(layer.prefill_step, FusedPrefill) for layer in rank.module.model.layers.values())
    prompts = _prompts(rank.args.vocab_size)
    want, _ = _logits(rank, prompts, fused=False)
    got, calls = _logits(rank, prompts, fused=True)
    assert calls == rank.args.n_layers
    # int8 and int4 products quantize their input rows (csrc/qpanel.h): the fused norms' last bits can move an input
    # that lies near half a step of its block's scale to the other int16 code, one part in 65534 of the block's max
    tol = 1e-4 if quantization == "none" else 1e-3
    assert (got - want).abs().max() <= tol * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@torch.no_grad()
def test_fused_prefill_keeps_a_prompt_its_own_beside_others(random_dirs):
    """A right-padded prompt's logits are the same bits alone and beside other prompts (serving's shared passes)."""
    from shardlm.runtime.slots import SlotCache

    rank = build(random_dirs["gqa12x4"], settings=Settings(kernels="gemv"), dtype="float32")
    args, model = rank.args, rank.module
    prompts = _prompts(args.vocab_size, (9, 9, 6))

    def run(group):
        cache = SlotCache(rank.layer_ids, 4, rank.kv_heads, 64, args.head_dim, torch.float32)
        width = max(len(p) for p in group)
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in group])  # (b, s)
        positions = torch.arange(width)[None].expand(len(group), width)
        mask = torch.ones(width, width, dtype=torch.bool).tril()[None, None].expand(len(group), 1, width, width)
        run = cache.prefill_rows(list(range(len(group))), [0] * len(group), width)
        return model(tokens, positions, mask, run)  # (b, s, vocab)

    together = run(prompts)
    for j, p in enumerate(prompts):
        alone = run([p])
        assert torch.equal(alone[0, :len(p)], together[j, :len(p)]), j


@torch.no_grad()
def test_fused_prefill_not_installed_or_taken_where_it_does_not_apply(random_dirs):
    rank = build(random_dirs["gqa12x4"], settings=Settings(kernels="gemv"), dtype="bfloat16")
    assert rank.kernels.prefill_layers == 0
    rank = build(random_dirs["gqa12x4"], settings=Settings(kernels="torch"), dtype="float32")
    assert rank.kernels.prefill_layers == 0
    rank = build(random_dirs["gqa12x4"], settings=Settings(kernels="gemv", fused=False), dtype="float32")
    assert rank.kernels.prefill_layers == 0
    rank = build(random_dirs["gqa12x4"], settings=Settings(kernels="gemv"), dtype="float32")
    layer = next(iter(rank.module.model.layers.values()))
    x = torch.randn(1, 1, rank.args.dim)  # one position: a decode, not a prefill
    assert layer.prefill_step(layer, x, None, None, None, None) is None
    layer.self_attn.prefill_attention = None  # no compiled attention: the modules run
    x = torch.randn(1, 3, rank.args.dim)
    cos = torch.ones(1, 1, 3, rank.args.head_dim)
    assert layer.prefill_step(layer, x, cos, cos, None, None) is None
