"""The linear-layer kernels agree with F.linear, for decode-sized and prefill-sized inputs; settings."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from refs import (blocks_of_32, int4_exact_reference, bf16_dot_reference, float_rows_reference, fused_block_inputs,
                  int8_exact_reference, int8_float_reference)
from shardlm import kernels
from shardlm.kernels.linear import LinearOps, OneDNNWeight
from shardlm.settings import Settings, SettingsError


@pytest.fixture(scope="module")
def ext():
    ops = kernels.extension(Settings().kernel_dir)
    assert ops is not None, "the decode kernel should build on this machine"
    return ops


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_t_matches_linear(rows, dtype, ext):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(301, 577, generator=g).to(dtype)  # odd sizes: remainder loops
    x = torch.randn(2, rows, 577, generator=g).to(dtype)
    got, want = kernels.matmul_t(x, w, ext), F.linear(x, w)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


@pytest.mark.parametrize("mode", ["gemv", "onednn", "torch"])
def test_install_linears_keeps_results_and_ties(mode, ext):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 50, bias=False))
    model[3].weight = model[0].weight  # a tied LM head
    x = torch.randint(0, 50, (1, 12))
    want = model(x)
    used, ops = kernels.choose_mode(mode, Settings().kernel_dir)
    assert used == mode
    kernels.install_linears(model.eval().requires_grad_(False), used, ops)
    assert model[3].weight is model[0].weight, "the tied weight must stay shared, not be packed into a copy"
    if mode != "torch":
        assert isinstance(model[1], LinearOps)
    if mode == "onednn":
        assert model[1].weight is None and isinstance(model[1].kernel_weight, OneDNNWeight)
    if mode == "gemv":
        assert model[1].gemv is ops
    assert torch.allclose(model(x), want, atol=1e-5)  # prefill-sized: F.linear or oneDNN
    assert torch.allclose(model(x[:, :1]), want[:, :1], atol=1e-5)  # decode-sized: the chosen kernel


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="not one of auto, gemv, onednn, torch"):
        kernels.choose_mode("fast", Settings().kernel_dir)


def test_settings_read_the_environment_once_and_refuse_bad_values(tmp_path):
    s = Settings.from_env({"SHARDLM_HOME": str(tmp_path), "SHARDLM_KERNELS": "torch", "SHARDLM_FUSED": "0",
                           "SHARDLM_CUDA_GRAPHS": "0", "SHARDLM_OFFLOAD_UNCACHED": "1"})
    assert (s.home, s.kernels, s.fused, s.cuda_graphs, s.offload_uncached) == (tmp_path, "torch", False, False, True)
    assert s.offload_dir == tmp_path / "offload" and s.kernel_dir == tmp_path / "kernels"
    assert Settings.from_env({}).kernels == "auto" and Settings.from_env({}).fused
    with pytest.raises(SettingsError, match="SHARDLM_KERNELS='fast' is not one of auto, gemv, onednn, torch"):
        Settings.from_env({"SHARDLM_KERNELS": "fast"})
    with pytest.raises(SettingsError, match="SHARDLM_FUSED='yes' is not 0 or 1"):
        Settings.from_env({"SHARDLM_FUSED": "yes"})


def test_only_the_settings_module_reads_the_environment():
    from pathlib import Path

    src = Path(kernels.__file__).resolve().parents[1]
    readers = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if "os.environ" in p.read_text()
                     and p.name != "settings.py")
    assert readers == [], f"read the environment in shardlm/settings.py only, not in {readers}"


@pytest.mark.parametrize("n,k", [(301, 577), (4, 8), (9, 7), (64, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rows_do_not_depend_on_the_batch_around_them(n, k, dtype, ext):
    """Each output row has its own accumulator and order: a row alone equals the same row in any batch (a
    served request's tokens must not depend on the requests beside it), for every tile shape and tail."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(16, k, generator=g)
    alone = torch.cat([ext.gemv(x[j:j + 1], w) for j in range(16)])  # (16, n)
    for b in (2, 3, 4, 5, 6, 8, 13, 15, 16):  # every mix of 512-bit pair tiles (8, 4, 2 rows) and single rows
        assert torch.equal(ext.gemv(x[:b], w), alone[:b]), b
    if dtype == torch.bfloat16 and ext.bf16_dot():  # bf16dot.h rounds x to bfloat16, as the module path does
        x = x.bfloat16().float()
    torch.testing.assert_close(alone, x @ w.float().T, atol=1e-3, rtol=1e-3)


def test_the_native_build_uses_the_bfloat16_dot_products_where_the_cpu_has_them(ext):
    """bf16dot.h is compiled in exactly where the CPU has avx512_bf16, and the rank's kernel description says so."""
    has = "avx512_bf16" in kernels.build.cpu_flags()
    assert ext.bf16_dot() == has
    named = "bfloat16 on avx512_bf16 dot products" if has else "bfloat16 widened to float32"
    assert named in kernels.build.units_of(ext)


def test_bfloat16_dot_products_flush_as_documented_at_the_edges_of_float32(ext):
    """bf16dot.h's edges, against refs.bf16_dot_reference: an x below float32's normal range is zero (also in the
    tail columns), a step's result just under 2^-126 that rounds up to it stays, and magnitudes from 2^-70 to 2^40
    agree bit for bit."""
    if not ext.bf16_dot():
        pytest.skip("this build keeps bf16rows.h's arithmetic (no avx512_bf16)")
    x, w = torch.zeros(1, 17), torch.zeros(3, 17).bfloat16()
    x[0, 16], w[:, 16] = 1e-39, 2.0 ** 100  # a subnormal x in the tail meets a huge weight
    x[0, 1], w[:, 1] = 2.0 ** -63, 2.0 ** -63  # odd column first: 2^-126 ...
    x[0, 0], w[:, 0] = 2.0 ** -75, -(2.0 ** -75)  # ... then minus 2^-150: rounds to 2^-126 without an exponent floor
    assert torch.equal(ext.gemv(x, w), bf16_dot_reference(x, w))
    g = torch.Generator().manual_seed(5)
    for _ in range(60):
        n, k, b = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 40), (1, 300), (1, 17)))
        w = (torch.randn(n, k, generator=g) * 2.0 ** float(torch.randint(-70, 40, (1,), generator=g))).bfloat16()
        x = torch.randn(b, k, generator=g) * 2.0 ** float(torch.randint(-70, 40, (1,), generator=g))
        assert torch.equal(ext.gemv(x, w), bf16_dot_reference(x, w)), (n, k, b)


@pytest.mark.parametrize("n,k", [(37, 203), (16, 64), (9, 7), (45, 600), (40, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_follows_the_documented_arithmetic_bit_for_bit(n, k, dtype, ext):
    """Every tile shape (one row, 256-bit pairs, 512-bit pairs, the lane sums) computes exactly the arithmetic
    `rows.h` (float32) and `bf16rows.h` (bfloat16) document, or `bf16dot.h` (bfloat16 on avx512_bf16 builds), so a
    faster tile can never change a token unnoticed."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(17, k, generator=g)
    dot = dtype == torch.bfloat16 and ext.bf16_dot()
    want = bf16_dot_reference(x, w) if dot else float_rows_reference(x, w)
    assert not torch.equal(want, (x.double() @ w.double().T).float()), "the reference must be able to differ"
    for b in (1, 2, 5, 8, 17):
        assert torch.equal(ext.gemv(x[:b], w), want[:b]), b


@pytest.mark.parametrize("n,k", [(301, 577), (96, 1000), (37, 200), (13, 96), (5, 40), (64, 32)])
def test_int8_gemv_equals_the_dequantized_weight(n, k, ext):
    """Integer dot products: equal to float arithmetic on the dequantized weight and the block-quantized input,
    close to it on the float input, and a row's result is the same alone or in any batch."""
    from shardlm.quant import quantize_int8

    g = torch.Generator().manual_seed(2)
    qw = quantize_int8(torch.randn(n, k, generator=g))  # codes padded to a multiple of 32 columns
    dequantized = qw.q[:, :k].float() * qw.scale.float()[:, None]  # (n, k)
    x = torch.randn(16, k, generator=g)
    x[3, :7] = 0  # a block that starts with zeros
    got = ext.gemv_int8(x, qw.q, qw.scale)
    seen = blocks_of_32(x) @ dequantized.T  # an input on a rounding tie may land one int16 step off: 1e-4
    assert (got - seen).abs().max() <= 1e-4 * seen.abs().max()
    want = x @ dequantized.T
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()  # the input's own rounding, 1/65534 of a block max
    alone = torch.cat([ext.gemv_int8(x[j:j + 1], qw.q, qw.scale) for j in range(16)])
    for b in (2, 3, 4, 5, 16):
        assert torch.equal(ext.gemv_int8(x[:b], qw.q, qw.scale), alone[:b]), b
    qw.gemv = ext  # the module path: rows of one position each (decode) through the integer kernel
    assert torch.equal(qw.matmul_t(x[:2]), got[:2])
    many = torch.randn(40, k, generator=g)
    want = many @ dequantized.T
    assert (qw.matmul_t(many) - want).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.parametrize("n,k", [(301, 577), (37, 200), (13, 96), (5, 40), (64, 32), (96, 1000)])
def test_int8_float_sums_follow_the_documented_arithmetic(n, k, ext):
    """The other int8 products' float lanes (qtile) are refs.int8_float_reference bit for bit at every batch size: 19,
    7, 3, 2, 1 and 32 blocks (an odd count ends on an even block), n not a multiple of 8 or 4 (tiles of 8, 4 and 1
    rows at batch 1, where a tile walks its rows one after another; 4 x 2 tiles and one-row tiles in batches)."""
    from shardlm.quant import quantize_int8

    if ext.int8_units() == "scalar":
        pytest.skip("a build without AVX2 sums in double (dot_q8_scalar)")
    g = torch.Generator().manual_seed(3)
    qw = quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(16, k, generator=g)
    want = int8_float_reference(x, qw.q, qw.scale, ext.int8_units())
    for b in (1, 2, 3, 4, 5, 16):
        assert torch.equal(ext.gemv_int8(x[:b], qw.q, qw.scale), want[:b]), b


@pytest.mark.parametrize("n,k", [(37, 200), (20, 576), (9, 1000), (5, 40)])
def test_int8_exact_sums_follow_the_documented_arithmetic(n, k, ext):
    """The o and down products' int8 sums (exact: one float64 term a block) are qrows.h's arithmetic bit for bit,
    over whole groups of blocks and the blocks after them, at every batch size."""
    from shardlm.quant import quantize_int8

    g = torch.Generator().manual_seed(9)
    qw = quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(6, k, generator=g)
    want = int8_exact_reference(x, qw.q, qw.scale)
    assert not torch.equal(want, ext.gemv_int8(x, qw.q, qw.scale)) or k <= 40, "float lane sums must be able to differ"
    for b in (1, 2, 6):
        assert torch.equal(ext.gemv_int8(x[:b], qw.q, qw.scale, exact=True), want[:b]), b


def test_int8_kernel_names_its_instructions_and_refuses_a_bad_width(ext):
    flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    if {"avx512f", "avx512bw"} <= flags:
        want = "avx512bw" + ("+avx512vnni" if "avx512_vnni" in flags else "")
    else:
        want = "avx2" + ("+avxvnni" if "avx_vnni" in flags else "") if "avx2" in flags else "scalar"
    assert ext.int8_units() == want
    with pytest.raises(RuntimeError, match="k rounded up to 32"):
        ext.gemv_int8(torch.randn(1, 40), torch.zeros(8, 40, dtype=torch.int8), torch.ones(8))


@pytest.mark.parametrize("n,k,start", [(301, 577, 0), (96, 1000, 13), (5, 40, 31), (64, 32, 0)])
def test_int4_gemm_equals_the_dequantized_weight(n, k, start, ext):
    """Our int4 layout and loop, for slices that start inside a group (a row-parallel rank's columns): equal to
    float arithmetic on the dequantized weight and the block-quantized input, for decode and prefill row counts,
    a row the same alone or in any batch, and the no-kernel fallback equal to the dequantized weight."""
    from shardlm.quant import quantize_int4

    g = torch.Generator().manual_seed(4)
    qw = quantize_int4(torch.randn(n, k, generator=g), start, start + k + 7)
    tiles, groups = -(-n // 16), (qw.pad_left + k + qw.pad_right) // 32
    assert qw.pad_left == start % 32 and qw.packed.shape == (tiles, groups, 256)
    assert qw.scales_zeros.shape == (tiles, groups, 32)
    dequantized = qw.dequantized()  # (n, k)
    x = torch.randn(40, k, generator=g)
    padded = F.pad(x, (qw.pad_left, qw.pad_right))  # the kernel quantizes the input where the groups fall
    seen = blocks_of_32(padded)[:, qw.pad_left:qw.pad_left + k]
    got = ext.gemm_int4(x, *qw.kernel_args())
    seen = seen @ dequantized.T
    assert (got - seen).abs().max() <= 1e-4 * seen.abs().max()
    want = x @ dequantized.T
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    alone = torch.cat([ext.gemm_int4(x[j:j + 1], *qw.kernel_args()) for j in range(16)])
    for b in (2, 3, 16):
        assert torch.equal(ext.gemm_int4(x[:b], *qw.kernel_args()), alone[:b]), b
    torch.testing.assert_close(qw.matmul_t(x), want, atol=1e-4, rtol=1e-4)  # no kernels: dequantized, float
    qw.gemv = ext
    assert torch.equal(qw.matmul_t(x[:3]), got[:3])
    with pytest.raises(RuntimeError, match="do not fit"):
        ext.gemm_int4(torch.randn(1, k + 64), *qw.kernel_args())
    with pytest.raises(RuntimeError, match=f"{n + 16} rows need"):
        ext.gemm_int4(x, qw.packed, qw.scales_zeros, qw.pad_left, n + 16)


def test_int4_dequantized_matches_the_codes():
    """The CPU layout unpacks to the codes it was packed from: W = (q - 8) * scale + zero."""
    from shardlm.quant import int4_codes, pack_int4

    w = torch.randn(7, 70, generator=torch.Generator().manual_seed(5))
    q, scale, zero, left, right = int4_codes(w, start=20, total=100)
    qw = pack_int4(q, scale, zero, 32, left, right)
    codes, s, z = qw.codes()
    assert torch.equal(codes, q.to(torch.uint8))
    assert torch.equal(s, scale.bfloat16().float()) and torch.equal(z, zero.bfloat16().float())  # stored in bfloat16
    want = ((q.float().view(7, -1, 32) - 8) * s[..., None] + z[..., None]).view(7, -1)[:, left:left + 70]
    assert torch.equal(qw.dequantized(), want)
    assert (qw.dequantized() - w).abs().max() <= (scale.max() / 2) * 1.05  # half a step, bfloat16 scales


@pytest.mark.parametrize("n,k,start", [(37, 200, 5), (16, 64, 0)])
def test_int4_exact_sums_are_the_integer_products_of_the_codes(n, k, start, ext):
    """The int4 tiles' byte dot products (each activation code as 256 * its high byte + its low byte) give the
    integer sums of the codes' products: the `exact` (double) results equal their emulation bit for bit, with codes
    at both ends of int16 (+-32767, whose high byte is -128 or 127), small negative ones (high byte -1, low 255) and
    zero blocks, alone and at 5 rows (the 4-row tiles)."""
    from shardlm.quant import quantize_int4

    g = torch.Generator().manual_seed(9)
    qw = quantize_int4(torch.randn(n, k, generator=g), start, start + k + 40)
    x = torch.randn(5, k, generator=g)
    x[0, :32] = torch.linspace(-1, 1, 32)  # codes from -32767 to 32767
    x[1, 7] = -50.0  # a block whose other codes are small negative and positive numbers
    x[2, 40:72] = 0.0
    x[3] = -x[3].abs()
    want = int4_exact_reference(x, qw)
    got = ext.gemm_int4(x, *qw.kernel_args(), True, True)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    alone = torch.cat([ext.gemm_int4(x[j:j + 1], *qw.kernel_args(), True, True) for j in range(5)])
    assert torch.equal(alone, want)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_quantized_partial_sums_add_up_to_the_whole_bit_for_bit(kind, parts, ext):
    """A row-parallel split: each part's float64 sums (wide), added in float64 and rounded once, equal the
    unsplit weight's result summed in double (exact, what a tp 1 rank runs for o and down projections) bit for
    bit, so quantized tokens do not depend on the tensor-parallel degree."""
    from shardlm.quant import int8_codes, pack_int8, quantize_int4

    g = torch.Generator().manual_seed(6)
    n, k = 70, 32 * 18
    w, x = torch.randn(n, k, generator=g), torch.randn(5, k, generator=g)
    bounds = [round(i * k / parts / 32) * 32 for i in range(parts + 1)]  # head-aligned column ranges
    if kind == "int8":
        q, scale = int8_codes(w)  # one scale per full row, as row-parallel ranks agree on it
        whole = ext.gemv_int8(x, *_int8_args(pack_int8(q, scale)), exact=True)
        fast = ext.gemv_int8(x, *_int8_args(pack_int8(q, scale)))
        wides = [ext.gemv_int8(x[:, a:b], *_int8_args(pack_int8(q[:, a:b], scale)), wide=True)
                 for a, b in zip(bounds, bounds[1:])]
    else:
        full = quantize_int4(w)
        whole = ext.gemm_int4(x, *full.kernel_args(), exact=True)
        fast = ext.gemm_int4(x, *full.kernel_args())
        wides = []
        for a, b in zip(bounds, bounds[1:]):
            part = quantize_int4(w[:, a:b], a, k)
            assert torch.equal(part.dequantized(), full.dequantized()[:, a:b])
            wides.append(ext.gemm_int4(x[:, a:b], *part.kernel_args(), wide=True))
    assert all(p.dtype == torch.float64 for p in wides)
    assert torch.equal(sum(wides).float(), whole)
    torch.testing.assert_close(fast, whole, atol=1e-4, rtol=1e-4)  # float sums: for rows no rank splits


def _int8_args(qw):
    return qw.q, qw.scale


def test_a_nan_input_gives_nan_rows_not_garbage(ext):
    """A NaN in an input row makes that row's outputs NaN (its block's scale carries it), other rows unchanged."""
    from shardlm.quant import quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(24, 64, generator=g), torch.randn(3, 64, generator=g)
    bad = x.clone()
    bad[1, 5] = float("nan")
    q8, q4 = quantize_int8(w), quantize_int4(w)
    for run in (lambda t: ext.gemv_int8(t, q8.q, q8.scale), lambda t: ext.gemm_int4(t, *q4.kernel_args())):
        clean, got = run(x), run(bad)
        assert torch.isnan(got[1]).all() and torch.equal(got[[0, 2]], clean[[0, 2]])


def test_a_block_too_small_to_scale_gives_zeros_not_undefined_codes(ext):
    """A block whose largest value is below ~1e-34 (32767 / max overflows float32): its codes are 0 (no cast of an
    infinity to int16), so its terms vanish, in decode and in prefill; other blocks count as usual."""
    from shardlm.quant import quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(24, 64, generator=g), torch.randn(3, 64, generator=g)
    tiny = x.clone()
    tiny[1, :32] = 1e-36  # (denormal steps: the factor 32767 / 1e-36 is infinite in float32)
    q8, q4 = quantize_int8(w), quantize_int4(w)
    rest = x.clone()
    rest[1, :32] = 0
    for run in (lambda t: ext.gemv_int8(t, q8.q, q8.scale), lambda t: ext.gemm_int4(t, *q4.kernel_args()),
                lambda t: ext.prefill_int8(t, q8.q, q8.scale), lambda t: ext.prefill_int4(t, *q4.kernel_args())):
        got = run(tiny)
        assert torch.isfinite(got).all() and torch.allclose(got[1], run(rest)[1], atol=1e-30)


def test_bfloat16_prefill_rows_are_multiplied_in_float32_without_bfloat16_units(monkeypatch):
    """Without avx512_bf16/AMX, oneDNN's bfloat16 matmul is several times slower than float32 (measured), so many
    bfloat16 rows are multiplied in float32 and rounded once; with the units the bfloat16 matmul runs."""
    from shardlm.kernels import linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 96, generator=g).bfloat16()  # (rows, in): more rows than the decode loop takes
    w = (torch.randn(64, 96, generator=g) * 0.1).bfloat16()  # (out, in)
    monkeypatch.setattr(linear, "bf16_units", lambda: False)
    via_float = linear.matmul_t(x, w)
    assert via_float.dtype == torch.bfloat16 and torch.equal(via_float, F.linear(x.float(), w.float()).bfloat16())
    monkeypatch.setattr(linear, "bf16_units", lambda: True)
    native = linear.matmul_t(x, w)
    assert torch.equal(native, F.linear(x, w))
    torch.testing.assert_close(native.float(), via_float.float(), rtol=2e-2, atol=2e-2)  # both round to bfloat16


def test_stale_kernel_builds_of_other_sources_are_removed(tmp_path):
    """Loading build `name` marks it used and removes builds of the same CPU and target for other sources unused
    for STALE_DAYS; recent ones, other targets and other CPUs stay."""
    import os
    import time

    from shardlm.kernels import build

    cpu, old = "a" * 10, time.time() - (build.STALE_DAYS + 1) * 86400
    names = {"mine": f"shardlm_kernels_{cpu}_11111111", "stale": f"shardlm_kernels_{cpu}_22222222",
             "recent": f"shardlm_kernels_{cpu}_33333333", "stale_haswell": f"shardlm_kernels_{cpu}_44444444_haswell",
             "other_cpu": f"shardlm_kernels_{'b' * 10}_55555555"}
    for key, name in names.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.so").write_bytes(b"")
        if key != "recent":
            os.utime(tmp_path / name, (old, old))
    removed = build.prune_stale_builds(tmp_path, names["mine"])
    assert removed == [tmp_path / names["stale"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for k, n in names.items() if k != "stale")
    assert (tmp_path / names["mine"]).stat().st_mtime > old + 86400, "the loaded build is marked as used"
    assert build.prune_stale_builds(tmp_path / "missing", names["mine"]) == []


@pytest.mark.parametrize("rows,inter", [(1, 16), (3, 13), (2, 1536)])
def test_mlp_activation_is_silu_of_gate_times_up(rows, inter, ext):
    """The fused MLP's activation, read through an identity down projection, is silu(gate) * up to float32
    rounding (the eight-lane exp is within 2 ulp), over whole runs of eight values and a last partial run
    (3 x 13 values end in a run of seven)."""
    g = torch.Generator().manual_seed(1)
    dim = inter  # the down projection is the identity, so the output is the activation itself
    x = torch.randn(rows, dim, generator=g)
    ln = torch.rand(dim, generator=g) + 0.5
    wg, wu = torch.randn(inter, dim, generator=g) / dim ** 0.5, torch.randn(inter, dim, generator=g) / dim ** 0.5
    out = ext.mlp_decode(x, ln, 1e-5, [wg, wu, torch.eye(dim)], None, None, None, None, False, None)
    x64 = x.double()
    xn = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * ln.double()
    gate, up = xn @ wg.double().T, xn @ wu.double().T
    want = gate * torch.sigmoid(gate) * up
    assert ((out.double() - want).abs() <= 2e-6 * want.abs() + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_unchanged_by_a_masked_key_inside_the_row(dtype, ext):
    """A masked cache position inside a row's span changes nothing: its weight is zero, the sum adds +0, the value
    sum skips it. The keys after it move one place along, so values that fell in a run of sixteen exps fall in a
    run of eight or the tail (25 keys: 16 + 8 + 1; 26: 16 + 8 + 2): the lanes must compute e^x alike."""
    g = torch.Generator().manual_seed(4)
    hkv, hd, length = 2, 12, 40
    x, ln, ws, cos, sin = fused_block_inputs(dtype, g, 1, hkv=hkv, hd=hd)
    keys, vals = (torch.randn(1, hkv, 24, hd, generator=g).to(dtype) for _ in range(2))
    outs = []
    for hole in (None, 2):
        kc, vc = (torch.randn(1, hkv, length, hd, generator=g).to(dtype) for _ in range(2))  # junk everywhere else
        at = [p for p in range(25) if p != hole][:24]  # the 24 cached keys' positions
        kc[:, :, at], vc[:, :, at] = keys, vals
        pos = 24 if hole is None else 25  # the new token's own position
        mask = torch.arange(length)[None] <= pos  # (1, length)
        if hole is not None:
            mask[0, hole] = False
        outs.append(ext.attn_decode(x, ln, 1e-5, ws, None, None, None, None, cos, sin, kc, vc, torch.tensor([0]),
                                    torch.tensor([pos]), torch.tensor([0, 0, 1, 1]), mask, None, True, None))
    assert torch.equal(*outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hd", [(6, 64), (5, 36), (3, 8)])
def test_decode_attention_of_a_head_does_not_depend_on_its_group(hq, hd, dtype, ext):
    """The query heads that read one KV head are attended together, up to four at a time (csrc/decode_attn.h): six
    heads run as a group of four and one of two, five as four and one. Each head's output equals its output as the
    only query head (bit for bit), and a float64 softmax(K q / sqrt(hd)) V over the cache to float32 rounding. The
    o projection is the identity, so the output is the heads themselves; rows have holes in their masks and
    different lengths, and hd 36 leaves a tail of four columns past the vector blocks."""
    g = torch.Generator().manual_seed(7)
    rows, hkv, slots, length = 3, 1, 4, 50
    dim = hq * hd
    x, ln, ws, cos, sin = fused_block_inputs(dtype, g, rows, dim=dim, hq=hq, hkv=hkv, hd=hd)
    kc, vc = (torch.randn(slots, hkv, length, hd, generator=g).to(dtype) for _ in range(2))
    slot, pos = torch.tensor([2, 0, 3]), torch.tensor([37, 12, 48])
    mask = torch.arange(pos.max() + 1)[None] <= pos[:, None]  # (rows, t)
    mask[0, 5:9] = False
    mask[2, :3] = False

    def attend(wq, heads):  # the o projection puts the heads in the output's first heads * hd columns
        k2, v2 = kc.clone(), vc.clone()
        o = torch.eye(dim, heads * hd).to(dtype)
        out = ext.attn_decode(x, ln, 1e-5, [wq, ws[1], ws[2], o], None, None, None, None, cos, sin, k2, v2, slot, pos,
                              torch.zeros(heads, dtype=torch.long), mask, None, False, None)
        return out, k2, v2

    together, keys, vals = attend(ws[0], hq)
    for h in range(hq):
        alone, _, _ = attend(ws[0][h * hd:(h + 1) * hd], 1)
        assert torch.equal(alone[:, :hd], together[:, h * hd:(h + 1) * hd]), f"head {h}"
    # float64 reference, from the q the kernel rotated: recompute q as the module path does
    x64 = x.double()
    xn = (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * ln.double()).to(dtype).double()
    q = (xn @ ws[0].double().T).view(rows, hq, hd)
    half = hd // 2
    rot = torch.cat([-q[..., half:], q[..., :half]], -1)
    q = q * cos.double()[:, None] + rot * sin.double()[:, None]
    for j in range(rows):
        k, v = keys[slot[j], 0, :pos[j] + 1].double(), vals[slot[j], 0, :pos[j] + 1].double()
        s = (q[j] @ k.T) / hd ** 0.5
        s = s.masked_fill(~mask[j, :pos[j] + 1], float("-inf"))
        want = (s.softmax(-1) @ v).reshape(-1)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        err = (together[j].double() - want).abs().max()
        assert torch.allclose(together[j].double(), want, atol=tol, rtol=tol), f"row {j}: off by {err}"


def test_argmax_rows_is_torch_argmax(ext):
    """Greedy sampling's kernel (csrc/argmax.h) against torch.argmax(dim=-1): ties (the first index), NaNs (the first
    NaN), infinities, all -inf rows, widths with tails past the eight-lane loop, one row split over the threads; a
    kernel that took the last tie, skipped NaNs or lost a half's tail fails it."""
    g = torch.Generator().manual_seed(5)
    for trial in range(400):
        rows = 1 if trial % 2 else int(torch.randint(2, 18, (1,), generator=g))
        width = int(torch.randint(1, 300, (1,), generator=g)) if trial % 5 else 49152 + trial % 7
        x = torch.randn(rows, width, generator=g)
        if trial % 3 == 0:
            x = x.round()  # many ties
        if trial % 7 == 0:
            x[torch.rand(rows, width, generator=g) < 0.01] = float("nan")
        if trial % 11 == 0:
            x[:] = float("-inf")
        if trial % 13 == 0:
            x[torch.rand(rows, width, generator=g) < 0.3] = float("inf")
        assert torch.equal(ext.argmax_rows(x), x.argmax(dim=-1)), (trial, rows, width)
    last = torch.zeros(1, 49152)
    last[0, -1] = 1.0  # the largest value in the second thread's half, at the very end
    assert ext.argmax_rows(last).tolist() == [49151]
    with pytest.raises(RuntimeError, match="float32 logits"):
        ext.argmax_rows(torch.zeros(3, dtype=torch.float64))
