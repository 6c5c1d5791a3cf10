"""The CPU prefill attention kernel (csrc/prefill_attn.h) against float64 SDPA, and its invariances: a row's result
alone equals the same row padded into a group, a prompt prefilled in chunks equals it prefilled at once, and the
model path takes it for passes of more than one position."""

import pytest
import torch
import torch.nn.functional as F

from shardlm.runtime.step import attention_mask


@pytest.fixture(scope="module")
def ext(kernel_ext):
    return kernel_ext


def _reference(q, k, v, kv_map, mask):
    """float64 SDPA with each query head reading KV head kv_map[h]."""
    k, v = k.double().index_select(1, kv_map), v.double().index_select(1, kv_map)
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask)


def _inputs(b, hq, hkv, s, t, hd, dtype, g):
    q = torch.randn(b, hq, s, hd, generator=g).to(dtype)
    k = torch.randn(b, hkv, t, hd, generator=g).to(dtype)
    v = torch.randn(b, hkv, t, hd, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("hd", [8, 12, 13, 64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_matches_float64_sdpa(hd, dtype, ext):
    """Odd head sizes (padded past the tile's columns), GQA with an irregular map (as uneven tp splits make), left
    padding in one row, a sliding window, and a chunk that starts past position 0 (s < t)."""
    g = torch.Generator().manual_seed(0)
    b, s, t = 2, 29, 41
    kv_map = torch.tensor([0, 0, 1, 2, 2])
    q, k, v = _inputs(b, 5, 3, s, t, hd, dtype, g)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :5] = False  # row 1 left-padded
    for window in (None, 9):
        mask = attention_mask(valid, t - s, s, window)  # (b, 1, s, t): queries at positions t - s .. t - 1
        got = ext.prefill_attention(q, k, v, kv_map, mask.contiguous())
        assert got.dtype == dtype and got.shape == q.shape
        want = _reference(q, k, v, kv_map, mask)
        tol = 2e-6 if dtype == torch.float32 else 1e-2
        assert (got.double() - want).abs().max() <= tol * want.abs().max(), window


def test_prefill_attention_past_the_kept_buffers_and_back(ext):
    """A chunk whose widened keys pass the 16 MiB each thread keeps (csrc/prefill_attn.h FloatKV::KEPT_FLOATS: 2 KV
    heads of 64 over 33000 keys need 4.2 M floats) runs on buffers of its own, then a short call on the kept ones;
    both as float64 SDPA, and the short one as before the long one, bit for bit."""
    g = torch.Generator().manual_seed(3)
    kv_map = torch.tensor([0, 1, 1])
    small = _inputs(1, 3, 2, 7, 40, 64, torch.float32, g)
    small_mask = attention_mask(torch.ones(1, 40, dtype=torch.bool), 33, 7, None).contiguous()
    before = ext.prefill_attention(*small, kv_map, small_mask)
    t = 33000
    q, k, v = _inputs(1, 3, 2, 5, t, 64, torch.float32, g)
    valid = torch.ones(1, t, dtype=torch.bool)
    valid[0, :70] = False  # left padding
    mask = attention_mask(valid, t - 5, 5, 2000).contiguous()  # a window: the rows' first keys are off a panel
    got = ext.prefill_attention(q, k, v, kv_map, mask)
    want = _reference(q, k, v, kv_map, mask)
    assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max()
    assert torch.equal(ext.prefill_attention(*small, kv_map, small_mask), before)


@pytest.mark.parametrize("hd", [64, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_rows_do_not_depend_on_the_rows_beside_them(hd, dtype, ext):
    """A prompt alone equals the same prompt right-padded into a group with a longer one (its padded keys masked),
    and prefilled in two chunks equals prefilled at once, bit for bit; in bfloat16 too, whose scores are dot
    products of word pairs on builds with avx512_bf16 (csrc/prefill_dot.h), and at an odd head size."""
    g = torch.Generator().manual_seed(1)
    hq, hkv = 6, 2
    kv_map = torch.arange(hq) // (hq // hkv)
    q, k, v = _inputs(2, hq, hkv, 37, 37, hd, dtype, g)
    short = 23
    alone_mask = attention_mask(torch.ones(1, short, dtype=torch.bool), 0, short, None).contiguous()
    alone = ext.prefill_attention(q[:1, :, :short].contiguous(), k[:1, :, :short].contiguous(),
                                  v[:1, :, :short].contiguous(), kv_map, alone_mask)
    valid = torch.ones(2, 37, dtype=torch.bool)
    valid[0, short:] = False  # row 0 right-padded to the group's width
    group = ext.prefill_attention(q, k, v, kv_map, attention_mask(valid, 0, 37, None).contiguous())
    assert torch.equal(group[:1, :, :short], alone)
    first = ext.prefill_attention(q[1:, :, :20].contiguous(), k[1:, :, :20].contiguous(), v[1:, :, :20].contiguous(),
                                  kv_map, attention_mask(torch.ones(1, 20, dtype=torch.bool), 0, 20, None).contiguous())
    second = ext.prefill_attention(q[1:, :, 20:].contiguous(), k[1:], v[1:], kv_map,
                                   attention_mask(torch.ones(1, 37, dtype=torch.bool), 20, 17, None).contiguous())
    assert torch.equal(torch.cat([first, second], dim=2), group[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_left_padding_and_windows_do_not_change_a_row(dtype, ext):
    """A prompt alone equals the same prompt left-padded by an odd or an even count into a group, with and without a
    sliding window, bit for bit: bfloat16 builds with avx512_bf16 pair each row's keys from its own first key
    (csrc/prefill_dot.h), and a window gives the rows of one block first keys of both parities."""
    g = torch.Generator().manual_seed(3)
    hd, hq, hkv, n = 64, 4, 2, 29
    kv_map = torch.tensor([0, 0, 1, 1])
    q, k, v = _inputs(1, hq, hkv, n, n, hd, dtype, g)
    # Equal weights (zero queries) and two values that cancel, 2^20 and -2^20, at the first two keys: a row whose
    # sum met a third key between those two would lose most of that key's bits, so a change in the order of a
    # row's sums shows in its output even in bfloat16, whose rounding hides float32 differences of a few units in
    # the last place. (A row's keys paired from an even slot instead of its own first key fails this.)
    q[:, :, :8] = 0
    v[:, :, 0], v[:, :, 1] = 2.0**20, -(2.0**20)
    for pad in (3, 2):
        width = n + pad
        grown = [torch.cat([torch.randn(1, x.shape[1], pad, hd, generator=g).to(dtype), x], dim=2) for x in (q, k, v)]
        other = _inputs(1, hq, hkv, width, width, hd, dtype, g)
        qg, kg, vg = (torch.cat([a, b]).contiguous() for a, b in zip(grown, other))
        valid = torch.ones(2, width, dtype=torch.bool)
        valid[0, :pad] = False
        for window in (None, 5):
            alone = ext.prefill_attention(q, k, v, kv_map,
                                          attention_mask(torch.ones(1, n, dtype=torch.bool), 0, n, window).contiguous())
            group = ext.prefill_attention(qg, kg, vg, kv_map, attention_mask(valid, 0, width, window).contiguous())
            assert torch.equal(group[:1, :, pad:], alone), (pad, window)


def test_bfloat16_prefill_attention_is_the_documented_pair_arithmetic(ext):
    """On builds with avx512_bf16, bfloat16 prefill attention equals its emulation (tests/refs.py
    prefill_pairs_reference) bit for bit: GQA with an irregular map, head sizes with and without an odd pair, left
    padding, a sliding window, a chunk past position 0."""
    if not ext.bf16_dot():
        pytest.skip("this CPU has no avx512_bf16: bfloat16 prefill attention keeps the float tiles here")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from refs import prefill_pairs_reference

    g = torch.Generator().manual_seed(4)
    kv_map = torch.tensor([0, 0, 1, 2, 2])
    for hd in (13, 32):
        q, k, v = _inputs(2, 5, 3, 19, 27, hd, torch.bfloat16, g)
        valid = torch.ones(2, 27, dtype=torch.bool)
        valid[1, :5] = False
        # Equal weights for the first rows and values 2^20, -2^20 at the second and third keys of each sequence's
        # span: an output then shows the order of its chain (bfloat16's rounding hides small differences).
        q[:, :, :8] = 0
        v[0, :, 1], v[0, :, 2], v[1, :, 6], v[1, :, 7] = 2.0**20, -(2.0**20), 2.0**20, -(2.0**20)
        for window in (None, 6):
            mask = attention_mask(valid, 8, 19, window).contiguous()
            got = ext.prefill_attention(q, k, v, kv_map, mask)
            assert torch.equal(got, prefill_pairs_reference(q, k, v, kv_map, mask)), (hd, window)


def test_prefill_attention_refuses_bad_inputs(ext):
    q, k, v = _inputs(1, 2, 1, 4, 4, 8, torch.float32, torch.Generator().manual_seed(2))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="kv_map\\[1\\] = 3 is not a KV head"):
        ext.prefill_attention(q, k, v, torch.tensor([0, 3]), mask)
    with pytest.raises(RuntimeError, match="mask \\(b, 1, s, t\\) bool expected"):
        ext.prefill_attention(q, k, v, torch.tensor([0, 0]), mask.float())
    with pytest.raises(RuntimeError, match="q, k and v in one dtype"):
        ext.prefill_attention(q, k.bfloat16(), v, torch.tensor([0, 0]), mask)


@torch.no_grad()
def test_model_prefill_takes_the_kernel(ext, monkeypatch):
    """A CPU rank with the compiled kernels computes prefill attention with it (not SDPA), and its logits stay
    within float32 rounding of the SDPA path."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from refs import build

    from shardlm.bundled import default_model_dir
    from shardlm.runtime.step import Batch, Rows

    rank = build(default_model_dir(), dtype="float32")
    layers = [layer.self_attn for layer in rank.module.model.layers.values()]
    assert all(a.prefill_attention is not None for a in layers)
    batch = Batch.from_lists([[1 + (7 * j) % 4000 for j in range(40)], [5, 6, 7]])

    def logits():
        rows = Rows.for_model(rank, batch, 2)
        return rows.forward(rank.module, batch.tokens, rows.prefill_mask())

    calls = []
    real = layers[0].prefill_attention
    monkeypatch.setattr(layers[0], "prefill_attention", lambda *a: calls.append(1) or real(*a))
    got = logits()
    assert calls == [1]
    for a in layers:
        monkeypatch.setattr(a, "prefill_attention", None)
    want = logits()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
