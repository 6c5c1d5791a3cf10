"""The prefill kernels: int8 and int4 weights widened once per call to panels of int16 pairs that meet the
block-quantized activation rows in the integer units (csrc/qpanel.h); float32 and bfloat16 weights widened to
float32 panels, multiplied in FMA tiles (csrc/qgemm.h).

Quantized: close to float64 arithmetic on the dequantized weight and the block-quantized input, on odd shapes
(widths off the block of 32, weight rows off the panel, row counts off the tile, int4 slices that start inside a
group); decode's arithmetic (int4 bit for bit, int8's exact sums bit for bit); a row's result the same alone, in any
batch and in any column-parallel slice of the weight; row-parallel partial sums adding up to the whole bit for bit;
the module path choosing them for passes of more than one position."""

import pytest
import torch
import torch.nn.functional as F

from refs import blocks_of_32, int8_exact_reference
from shardlm.kernels import linear
from shardlm.quant import int8_codes, pack_int8, prefill_rows, quantize_int4, quantize_int8


@pytest.fixture(scope="module")
def ext(kernel_ext):
    return kernel_ext


def _int8(n, k, g):
    qw = quantize_int8(torch.randn(n, k, generator=g))
    return qw, qw.q[:, :k].double() * qw.scale.double()[:, None]  # (n, k) dequantized


def _int4(n, k, start, g):
    qw = quantize_int4(torch.randn(n, k, generator=g), start, start + k + 5)
    return qw, qw.dequantized().double()


def _run(ext, kind, qw, x, exact=False, wide=False):
    if kind == "int8":
        return ext.prefill_int8(x, qw.q, qw.scale, exact, wide)
    return ext.prefill_int4(x, *qw.kernel_args(), exact, wide)


def _weight(kind, n, k, start, g):
    return _int8(n, k, g) if kind == "int8" else _int4(n, k, start, g)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("n,k,start", [(301, 577, 0), (17, 1000, 13), (5, 40, 31), (64, 32, 0), (48, 96, 7)])
@pytest.mark.parametrize("exact", [False, True])
def test_prefill_is_close_to_float64_on_the_dequantized_weight(kind, n, k, start, exact, ext):
    g = torch.Generator().manual_seed(n + k)
    qw, dequantized = _weight(kind, n, k, start, g)
    for rows in (1, 5, 6, 7, 50):
        x = torch.randn(rows, k, generator=g)
        got = _run(ext, kind, qw, x, exact)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        pad = qw.pad_left if kind == "int4" else 0  # int4: the blocks count from the weight's padded column 0
        seen = blocks_of_32(F.pad(x, (pad, 0)).double())[:, pad:] @ dequantized.T  # the input the kernel sees
        assert (got.double() - seen).abs().max() <= 1e-4 * seen.abs().max(), (rows, exact)  # a tie: one step off
        want = x.double() @ dequantized.T  # (rows, n)
        assert (got.double() - want).abs().max() <= 1e-3 * want.abs().max(), (rows, exact)  # 1/65534 of a block max


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("n,k,start", [(301, 577, 0), (17, 1000, 13), (37, 200, 0), (48, 96, 7), (301, 2100, 0)])
def test_prefill_takes_decodes_arithmetic(kind, n, k, start, ext):
    """The products a prompt's tokens get are the ones decode gives the same rows: int4 (plain and exact) and int8's
    exact sums (qrows.h's documented arithmetic) bit for bit; float64 partial sums (`wide`) to float64 rounding,
    as the same block terms are added in another order. (A width of 2100: one panel a thread's chunk, so each thread
    widens several chunks in turn.)"""
    g = torch.Generator().manual_seed(n * k)
    qw, _ = _weight(kind, n, k, start, g)
    x = torch.randn(23, k, generator=g)
    if kind == "int8":
        decode = lambda exact, wide: ext.gemv_int8(x, qw.q, qw.scale, exact, wide)  # noqa: E731
        assert torch.equal(_run(ext, kind, qw, x, exact=True), int8_exact_reference(x, qw.q, qw.scale))
    else:
        decode = lambda exact, wide: ext.gemm_int4(x, *qw.kernel_args(), exact, wide)  # noqa: E731
        assert torch.equal(_run(ext, kind, qw, x), decode(False, False))
    assert torch.equal(_run(ext, kind, qw, x, exact=True), decode(True, False))
    wide, want = _run(ext, kind, qw, x, wide=True), decode(True, True)
    assert wide.dtype == torch.float64 and (wide - want).abs().max() <= 1e-14 * want.abs().max()


def _int8_plain_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """qpanel.h's plain int8 arithmetic, emulated: x quantized per block as decode quantizes it (refs), each block's
    integer sum of codes times weight codes, then per output one float32 FMA chain over the blocks in order, acc =
    fma(float(isum), x scale, acc) (the product exact in float64, the sum rounded to float64 then float32: an FMA's
    single rounding but at double-rounding ties, about 2**-29 a step; these fixed inputs meet none), times the row's
    scale in float32. (b, n) float32."""
    b, k = x.shape
    kp = q.shape[1]
    blocks = F.pad(x, (0, kp - k)).view(b, kp // 32, 32)  # (b, blocks, 32)
    amax = blocks.abs().amax(-1)  # (b, blocks)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767).div(amax), torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None]).to(torch.int64)  # (b, blocks, 32)
    isum = torch.einsum("jbc,rbc->jrb", codes, q.to(torch.int64).view(q.shape[0], kp // 32, 32))  # (b, n, blocks)
    d = (amax / 32767)[:, None, :]  # (b, 1, blocks)
    acc = torch.zeros(b, q.shape[0], dtype=torch.float32)
    for blk in range(kp // 32):
        acc = (isum[..., blk].float().double() * d[..., blk].double() + acc.double()).float()
    return acc * scale.float()[None, :]


def test_int8_prefill_follows_the_documented_arithmetic(ext):
    """Plain int8 prefill (q, k, v, gate, up): qpanel.h's chain bit for bit, over rows and outputs off the tile and
    the panel. It is not decode's (sixteen float lanes a row): the two must be able to differ."""
    g = torch.Generator().manual_seed(12)
    qw = quantize_int8(torch.randn(37, 200, generator=g))
    x = torch.randn(15, 200, generator=g)
    want = _int8_plain_reference(x, qw.q, qw.scale)
    assert torch.equal(_run(ext, "int8", qw, x), want)
    assert not torch.equal(ext.gemv_int8(x, qw.q, qw.scale), want), "decode's lane sums must be able to differ"


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_prefill_of_no_rows_and_of_rows_with_nan(kind, ext):
    """No rows: an empty result of the right shape. A NaN or an infinity in a row (in a whole block or in the last,
    padded one): that row's outputs NaN, the other rows unchanged, as in decode."""
    g = torch.Generator().manual_seed(13)
    qw, _ = _weight(kind, 40, 200, 0, g)
    for exact, wide in ((False, False), (True, False), (False, True)):
        empty = _run(ext, kind, qw, torch.zeros(2, 0, 200), exact, wide)
        assert empty.shape == (2, 0, 40) and empty.dtype == (torch.float64 if wide else torch.float32)
    x = torch.randn(4, 200, generator=g)
    bad = x.clone()
    bad[1, 5], bad[2, 199] = float("nan"), float("inf")
    for exact in (False, True):
        clean, got = _run(ext, kind, qw, x, exact), _run(ext, kind, qw, bad, exact)
        assert torch.isnan(got[1:3]).all() and torch.equal(got[[0, 3]], clean[[0, 3]]), exact


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_row_is_the_same_alone_in_any_batch_and_in_any_column_slice(kind, ext):
    """One chain of block terms per output, in block order: no dependence on the rows around it (a prompt alone or
    beside others) or on how many weight rows a column-parallel rank holds."""
    g = torch.Generator().manual_seed(9)
    n, k = 70, 200
    qw, _ = _weight(kind, n, k, 0, g)
    x = torch.randn(23, k, generator=g)
    whole = _run(ext, kind, qw, x)
    alone = torch.cat([_run(ext, kind, qw, x[j:j + 1]) for j in range(23)])
    assert torch.equal(whole, alone)
    for b in (2, 6, 13):
        assert torch.equal(_run(ext, kind, qw, x[:b]), whole[:b]), b
    w = torch.randn(n, k, generator=g)
    full = quantize_int8(w) if kind == "int8" else quantize_int4(w)
    y = _run(ext, kind, full, x)
    for a, b in [(0, 16), (16, 37), (37, 70)]:  # slices of rows that do not fall on panels (16 or 32 rows)
        part = pack_int8(full.q[a:b], full.scale[a:b]) if kind == "int8" else quantize_int4(w[a:b])
        assert torch.equal(_run(ext, kind, part, x), y[:, a:b]), (a, b)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_prefill_partial_sums_add_up_to_the_whole_bit_for_bit(kind, parts, ext):
    """A row-parallel split on blocks of 32: each part's float64 sums (wide), added in float64 and rounded once,
    equal the unsplit weight's exact result, so quantized prefill does not depend on the tensor-parallel degree."""
    g = torch.Generator().manual_seed(6)
    n, k = 70, 32 * 18
    w, x = torch.randn(n, k, generator=g), torch.randn(29, k, generator=g)
    bounds = [round(i * k / parts / 32) * 32 for i in range(parts + 1)]
    if kind == "int8":
        q, scale = int8_codes(w)
        whole = _run(ext, kind, pack_int8(q, scale), x, exact=True)
        wides = [_run(ext, kind, pack_int8(q[:, a:b], scale), x[:, a:b], wide=True) for a, b in zip(bounds, bounds[1:])]
    else:
        whole = _run(ext, kind, quantize_int4(w), x, exact=True)
        wides = [_run(ext, kind, quantize_int4(w[:, a:b], a, k), x[:, a:b], wide=True) for a, b in zip(bounds, bounds[1:])]
    assert all(p.dtype == torch.float64 for p in wides)
    assert torch.equal(sum(wides).float(), whole)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_module_path_takes_prefill_kernels_for_passes_of_more_than_one_position(kind, ext):
    g = torch.Generator().manual_seed(3)
    qw, _ = _weight(kind, 40, 96, 0, g)
    qw.gemv = ext
    prompt, step = torch.randn(2, 9, 96, generator=g), torch.randn(4, 1, 96, generator=g)
    assert prefill_rows(prompt) and not prefill_rows(step) and not prefill_rows(step.view(4, 96))
    assert torch.equal(qw.matmul_t(prompt), _run(ext, kind, qw, prompt))
    decode = ext.gemv_int8(step, qw.q, qw.scale) if kind == "int8" else \
        ext.gemm_int4(step, *qw.kernel_args())
    assert torch.equal(qw.matmul_t(step), decode)
    half = qw.matmul_t(prompt.bfloat16())
    assert half.dtype == torch.bfloat16 and half.shape == (2, 9, 40)


def test_prefill_kernels_refuse_inputs_that_do_not_fit_the_codes(ext):
    with pytest.raises(RuntimeError, match="k rounded up to 32"):
        ext.prefill_int8(torch.randn(3, 40), torch.zeros(8, 40, dtype=torch.int8), torch.ones(8))
    qw = quantize_int4(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="do not fit"):
        ext.prefill_int4(torch.randn(3, 128), qw.packed, qw.scales_zeros, 0, qw.out)


@pytest.mark.parametrize("n,k", [(301, 577), (17, 1000), (5, 40), (64, 32), (100, 77)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_prefill_equals_float64_and_a_row_is_the_same_in_any_batch(n, k, dtype, ext):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(23, k, generator=g)
    got = ext.prefill_float(x, w)
    want = x.double() @ w.double().T
    bound = 1e-6 * k ** 0.5 * (x.abs().max() * w.float().abs().max()).item()
    assert got.dtype == torch.float32 and (got.double() - want).abs().max().item() <= bound
    assert torch.equal(torch.cat([ext.prefill_float(x[j:j + 1], w) for j in range(23)]), got)
    assert torch.equal(ext.prefill_float(x[:7], w), got[:7])
    half = ext.prefill_float(x.bfloat16(), w)
    assert half.dtype == torch.bfloat16


@pytest.mark.parametrize("n,k", [(301, 577), (17, 1000), (5, 40), (64, 32), (7, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_prefill_in_place_and_through_panels_give_the_same_bits(n, k, dtype, ext):
    """A pass of a few rows reads the weight in place (csrc/fewrows.h), a larger one widens panels (csrc/qgemm.h):
    the same FMA chain per output either way, so a prompt's numbers do not depend on the rows of its pass. Row counts
    off the blocks of 8 or 16 rows and off the panel tiles of 8, 4 and 2; the few_rows argument forces either."""
    g = torch.Generator().manual_seed(3 * n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    for b in (1, 3, 16, 17, 23, 32, 33, 45, 64, 65, 100, 128, 129):  # one to nine blocks of x rows in place
        x = torch.randn(b, k, generator=g)
        panels, in_place = ext.prefill_float(x, w, 0), ext.prefill_float(x, w, 1000)
        assert torch.equal(panels, in_place), b
        assert torch.equal(ext.prefill_float(x, w), panels), b  # the default crossover between them
    assert ext.prefill_float(torch.randn(0, k), w, 1000).shape == (0, n)


def test_float_prefill_refuses_a_width_that_does_not_match(ext):
    with pytest.raises(RuntimeError, match="shapes"):
        ext.prefill_float(torch.randn(3, 40), torch.randn(8, 41))


@pytest.mark.parametrize("units", [False, True])
def test_plain_weights_take_the_panel_kernel_for_prefill_passes(units, ext, monkeypatch):
    """float32 prefill through the panel kernel; bfloat16 through it only without bfloat16 units (else oneDNN's
    bfloat16 matmul); decode rows through the row loop."""
    monkeypatch.setattr(linear, "bf16_units", lambda: units)
    g = torch.Generator().manual_seed(8)
    w = torch.randn(40, 96, generator=g)
    prompt, step = torch.randn(2, 9, 96, generator=g), torch.randn(4, 1, 96, generator=g)
    assert torch.equal(linear.matmul_t(prompt, w, ext), ext.prefill_float(prompt, w))
    assert torch.equal(linear.matmul_t(step, w, ext), ext.gemv(step, w))
    wb, pb = w.bfloat16(), prompt.bfloat16()
    got = linear.matmul_t(pb, wb, ext)
    if units:
        assert torch.equal(got, F.linear(pb, wb))
    else:
        assert torch.equal(got, ext.prefill_float(pb, wb))
    assert torch.equal(linear.matmul_t(prompt, w), F.linear(prompt, w))  # no kernels: torch
