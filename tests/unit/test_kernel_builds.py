"""The kernels built for older CPUs than this one (AVX2 without AVX-512; no AVX at all) on this machine: each build
names its instructions, and the int4 row tiles and the int8 exact sums give the native build's numbers bit for bit
(one arithmetic on every build, q4tiles.h and qrows.h), for decode and prefill row counts, split and whole, as do
the int8 and int4 prefill panels (qpanel.h); float prefill panels equal wherever the CPU has FMA; float decode rows (256-bit tiles on AVX2, 512-bit pairs of rows on AVX-512;
bfloat16 rows 16 columns a step, bf16rows.h) and prefill attention (8- or 16-lane tiles), and the fused decode
blocks, equal wherever the CPU has FMA, but for bfloat16 rows where this CPU has avx512_bf16 (bf16dot.h rounds x to
bfloat16: the older build is held to bf16rows.h's arithmetic instead); greedy argmax equal to torch's on every
build; interleaved int8 codes' exact sums equal the native build's natural ones (qexact.h)."""

from __future__ import annotations

import os
import concurrent.futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from refs import bf16_dot_reference, float_rows_reference, fused_block_inputs, int8_float_reference
from shardlm.kernels import build
from shardlm.quant import quantize_int4, quantize_int8

TARGETS = {"skylake-avx512": ("avx512bw", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "fma"}),
           "haswell": ("avx2", {"avx2", "fma", "f16c"}), "x86-64": ("scalar", set())}
"""Older builds: AVX-512 without VNNI or avx512_bf16 (bf16rows.h's 512-bit tiles, which a native build with
avx512_bf16 no longer runs), AVX2, and no vector extensions past SSE2."""
OPT_IN = {"skylake-avx512": "SHARDLM_TEST_AVX512_BUILD"}
"""Builds the suite leaves out unless their variable is 1: the AVX-512 build without VNNI or avx512_bf16 (on a host
with AVX-512, the three builds side by side took 78 s of a suite run on two cores, 2026-11-29); run it with
`SHARDLM_TEST_AVX512_BUILD=1 .venv/bin/python -m pytest tests/unit/test_kernel_builds.py`."""
_BUILDS: dict = {}
"""arch -> a future of its build, every build this CPU can run started at the first test that needs one."""


def _wanted(arch: str) -> bool:
    """Whether this run builds `arch`: it is not opt-in, or its variable is 1."""
    return arch not in OPT_IN or os.environ.get(OPT_IN[arch]) == "1"


def _lowest_priority() -> None:
    """Run this thread, and the compilers it starts, at nice 19 (on Linux the priority is per thread, and children
    inherit it): the builds take the cores the other tests leave idle, and all of them once a test waits for them."""
    os.setpriority(os.PRIO_PROCESS, 0, 19)


def start_builds(root: Path) -> None:
    """Start every build this CPU can run and this run wants (_wanted) side by side in the background, into folders
    under `root`. conftest calls this as soon as collection has chosen a test of this module, so the builds (one
    compiler process of 40-70 s each on two cores) overlap the tests before it instead of stopping the suite."""
    if _BUILDS:
        return
    pool = ThreadPoolExecutor(max_workers=len(TARGETS), initializer=_lowest_priority)
    for name, (_, wants) in TARGETS.items():
        if wants <= build.cpu_flags() and _wanted(name):
            _BUILDS[name] = pool.submit(build.extension, root / name, arch=name)
    pool.shutdown(wait=False)


def wait_builds(timeout_s: float) -> None:
    """Wait up to `timeout_s` for the started builds to end (done, failed or not), so their folder can go."""
    concurrent.futures.wait(list(_BUILDS.values()), timeout=timeout_s)


def _older_build(arch: str, tmp_path_factory):
    """The `arch` build of the kernels, built once for the session; skips where this CPU lacks what the build needs.
    The builds start at collection (start_builds), or here when this module was not collected by conftest."""
    needs = TARGETS[arch][1]
    if not needs <= build.cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - build.cpu_flags())} for a {arch} build")
    if not _wanted(arch):
        pytest.skip(f"the {arch} build is opt-in (suite time): set {OPT_IN[arch]}=1 to run it")
    start_builds(tmp_path_factory.mktemp("builds"))
    ext = _BUILDS[arch].result(timeout=600)
    assert ext is not None, f"the {arch} build failed (see the warning logged above)"
    return ext


def test_only_native_intel_builds_ask_for_their_streams_into_l1(monkeypatch):
    """csrc/rows.h and qrows.h: the batch-1 prefetch into L1 is an Intel build's (measured faster there, not on
    Zen 4); it changes no arithmetic, so the older builds' tests below check the same numbers either way."""
    monkeypatch.setattr(build, "cpu_vendor", lambda: "GenuineIntel")
    assert "-DSHARDLM_L1_AHEAD" in build.compile_flags()
    assert "-DSHARDLM_L1_AHEAD" not in build.compile_flags("haswell")
    monkeypatch.setattr(build, "cpu_vendor", lambda: "AuthenticAMD")
    assert "-DSHARDLM_L1_AHEAD" not in build.compile_flags()
    monkeypatch.undo()
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    assert build.cpu_vendor() == next((v.split(":")[1].strip() for v in lines if v.startswith("vendor_id")), "")


@pytest.fixture(scope="module")
def native(kernel_ext):
    return kernel_ext


@pytest.mark.parametrize("arch", list(TARGETS))
def test_an_older_build_names_its_units_and_gives_the_native_int4_numbers(arch, native, tmp_path_factory):
    units, needs = TARGETS[arch]
    ext = _older_build(arch, tmp_path_factory)
    assert ext.int8_units() == units
    assert build.units_of(ext) == f"int8 on {units}, bfloat16 widened to float32"  # what a rank's log names
    g = torch.Generator().manual_seed(11)
    w, x = torch.randn(45, 200, generator=g), torch.randn(5, 200, generator=g)
    whole = quantize_int4(w)
    for rows in (1, 3, 5):  # decode: integer tiles, float and double sums
        for exact in (False, True):
            assert torch.equal(ext.gemm_int4(x[:rows], *whole.kernel_args(), exact),
                               native.gemm_int4(x[:rows], *whole.kernel_args(), exact)), (rows, exact)
    part = quantize_int4(w[:, 40:], 40, 200)  # a row-parallel slice starting inside a group
    assert torch.equal(ext.gemm_int4(x[:, 40:], *part.kernel_args(), wide=True),
                       native.gemm_int4(x[:, 40:], *part.kernel_args(), wide=True))
    many = torch.randn(40, 200, generator=g)  # prefill: integer panels, decode's arithmetic, equal on every build
    q8 = quantize_int8(w)
    for exact, wide in ((False, False), (True, False), (False, True)):
        assert torch.equal(ext.prefill_int4(many, *whole.kernel_args(), exact, wide),
                           native.prefill_int4(many, *whole.kernel_args(), exact, wide)), (exact, wide)
        assert torch.equal(ext.prefill_int8(many, q8.q, q8.scale, exact, wide),
                           native.prefill_int8(many, q8.q, q8.scale, exact, wide)), (exact, wide)
    assert torch.equal(ext.prefill_int4(many[:, 40:], *part.kernel_args(), False, True),
                       native.prefill_int4(many[:, 40:], *part.kernel_args(), False, True))
    logits = torch.randn(6, 1003, generator=g).round()  # greedy sampling: torch's argmax (first tie, first NaN)
    logits[2, 500:] = float("nan")
    for rows in (1, 6):
        assert torch.equal(ext.argmax_rows(logits[:rows]), logits[:rows].argmax(dim=-1)), rows
    for dtype in (torch.float32, torch.bfloat16):  # float rows: eight-lane accumulators on every build
        for n, k in ((37, 203), (40, 96)):  # a tail of columns, and none (the AVX-512 tiles' transposed sums)
            wf, xs = torch.randn(n, k, generator=g).to(dtype), torch.randn(17, k, generator=g)
            for b in (1, 2, 5, 8, 13, 17):
                got, want = ext.gemv(xs[:b], wf), native.gemv(xs[:b], wf)
                if dtype == torch.bfloat16 and native.bf16_dot():  # this CPU's bfloat16 rows: dot products (bf16dot.h)
                    assert not ext.bf16_dot() and torch.equal(want, bf16_dot_reference(xs[:b], wf)), (n, k, b)
                    want = float_rows_reference(xs[:b], wf)  # the older build keeps bf16rows.h's arithmetic
                if "fma" in needs:
                    assert torch.equal(got, want), (dtype, n, k, b)
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for dtype in (torch.float32, torch.bfloat16):  # float prefill: in place (few rows) or through panels, one chain
        wf, xs = torch.randn(29, 203, generator=g).to(dtype), torch.randn(40, 203, generator=g)
        for b in (3, 16, 40):
            panels, in_place = ext.prefill_float(xs[:b], wf, 0), ext.prefill_float(xs[:b], wf, 1000)
            assert torch.equal(panels, in_place), (dtype, b)  # one build: the same fma (or multiply-add) chains
            if "fma" in needs:
                assert torch.equal(panels, native.prefill_float(xs[:b], wf)), (dtype, b)
            else:
                torch.testing.assert_close(panels, native.prefill_float(xs[:b], wf), rtol=1e-5, atol=1e-4)
    for dtype in (torch.float32, torch.bfloat16):  # prefill attention: the same chains with 8- or 16-lane tiles
        q, k, v = (torch.randn(2, 5, n, 12, generator=g).to(dtype) for n in (19, 23, 23))
        kv, mask = torch.tensor([0, 0, 1, 3, 4]), torch.ones(23, 23, dtype=torch.bool).tril()[None, None, 4:]
        mask = mask.expand(2, 1, 19, 23).contiguous()
        got, want = ext.prefill_attention(q, k, v, kv, mask), native.prefill_attention(q, k, v, kv, mask)
        if dtype == torch.bfloat16 and native.bf16_dot():  # this CPU's pair dot products (prefill_dot.h): its own
            # bits, both builds within bfloat16 rounding of float64 attention
            exact = F.scaled_dot_product_attention(q.double(), k.double().index_select(1, kv),
                                                   v.double().index_select(1, kv), attn_mask=mask)
            for out in (got, want):
                assert (out.double() - exact).abs().max() <= 1e-2 * exact.abs().max(), arch
        elif "fma" in needs:
            assert torch.equal(got, want), dtype
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-4)
    q8 = quantize_int8(w)  # int8 rows: each build's own lane sums, the same value to float rounding
    torch.testing.assert_close(ext.gemv_int8(x, q8.q, q8.scale), native.gemv_int8(x, q8.q, q8.scale),
                               rtol=1e-5, atol=1e-5)
    q8, x8 = quantize_int8(torch.randn(45, 600, generator=g)), torch.randn(5, 600, generator=g)  # 19 blocks
    for rows in (1, 5):  # int8 o and down sums (exact): one term a block on every build, equal bit for bit
        assert torch.equal(ext.gemv_int8(x8[:rows], q8.q, q8.scale, exact=True),
                           native.gemv_int8(x8[:rows], q8.q, q8.scale, exact=True)), rows
    _int8_float_lanes(ext, units, g)


def _int8_float_lanes(ext, units: str, g: torch.Generator) -> None:
    """An older build's int8 float lanes: a row the same alone or in a batch, with vector units the documented
    arithmetic (refs.int8_float_reference: AVX2 one chain of eight lanes a pair, AVX-512 without VNNI two chains of a
    pair of blocks each) bit for bit, and the same numbers from paired codes (csrc/qpairs.h: each block's halves 32
    bytes apart on AVX2, the scalar build's positions), decode and prefill; 7 blocks (3 pairs and an odd one), rows
    in tiles of 8, 4 and 1."""
    from shardlm.quant import pair_columns

    q8, x8 = quantize_int8(torch.randn(37, 200, generator=g)), torch.randn(5, 200, generator=g)
    alone = torch.cat([ext.gemv_int8(x8[j:j + 1], q8.q, q8.scale) for j in range(5)])
    for rows in (2, 3, 5):
        assert torch.equal(ext.gemv_int8(x8[:rows], q8.q, q8.scale), alone[:rows]), rows
    if units != "scalar":
        assert torch.equal(alone, int8_float_reference(x8, q8.q, q8.scale, units))
    moved = pair_columns(q8.q)
    for rows in (1, 2, 5):
        assert torch.equal(ext.gemv_int8(x8[:rows], moved, q8.scale, paired=True), alone[:rows]), rows
    assert torch.equal(ext.prefill_int8(x8, moved, q8.scale, paired=True), ext.prefill_int8(x8, q8.q, q8.scale))


def _decode_inputs(dt, g):
    """A fused decode block's inputs (csrc/decode.h): three rows at positions 37, 20 and 5 of a four-slot cache, the
    middle one with a masked hole (the softmax's per-key path), keys of 38 positions (runs of 16, of 8, and a tail)."""
    hkv, hd, slots, length = 2, 12, 4, 40
    x, ln, ws, cos, sin = fused_block_inputs(dt, g, 3, hkv=hkv, hd=hd)
    kc, vc = (torch.randn(slots, hkv, length, hd, generator=g).to(dt) for _ in range(2))
    rows, pos = torch.tensor([2, 0, 3]), torch.tensor([37, 20, 5])
    mask = torch.arange(length)[None] <= pos[:, None]  # (b, length)
    mask[1, 3] = False
    return x, ln, ws, cos, sin, kc, vc, rows, pos, torch.tensor([0, 0, 1, 1]), mask


@pytest.mark.parametrize("arch", list(TARGETS))
def test_an_older_build_gives_the_native_decode_blocks(arch, native, tmp_path_factory):
    """The MLP's silu and the softmaxes take e^x sixteen lanes at a time on AVX-512 builds and eight on others, one
    arithmetic in every lane, and the blocks' norms sum their squares in eight lanes on every build: a fused decode
    block (attention and MLP, cache writes included) and prefill attention over rows of 45 keys (runs of 16, of 8,
    and a tail; one row with masked keys inside its range) equal wherever the CPU has FMA."""
    needs = TARGETS[arch][1]
    ext = _older_build(arch, tmp_path_factory)
    g = torch.Generator().manual_seed(12)
    for dt in (torch.float32, torch.bfloat16):
        x, ln, ws, cos, sin, kc, vc, rows, pos, kv_map, mask = _decode_inputs(dt, g)
        caches = [(kc.clone(), vc.clone()) for _ in range(2)]
        got, want = (e.attn_decode(x, ln, 1e-5, ws, None, None, None, None, cos, sin, *c, rows, pos, kv_map, mask,
                                   None, True, None) for e, c in zip((ext, native), caches))
        inter = 45  # two runs of 16, one of 8, a tail of 5 per row
        wg, wu = (torch.randn(inter, 48, generator=g).to(dt) for _ in range(2))
        wd = torch.randn(48, inter, generator=g).to(dt)
        mlp = [e.mlp_decode(x * 3, ln, 1e-5, [wg, wu, wd], None, None, None, None, True, None) for e in (ext, native)]
        q, k, v = (torch.randn(2, 4, n, 12, generator=g).to(dt) for n in (45, 45, 45))
        causal = torch.ones(45, 45, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)  # (2, 1, 45, 45)
        causal[1, :, :, 30] = False  # keys masked inside the later rows' ranges
        attn = [e.prefill_attention(q, k, v, kv_map, causal) for e in (ext, native)]
        dot = dt == torch.bfloat16 and native.bf16_dot()  # this CPU's bfloat16 products round x (bf16dot.h)
        if "fma" in needs and not dot:
            assert torch.equal(got, want) and torch.equal(caches[0][0], caches[1][0]), dt
            assert torch.equal(*mlp) and torch.equal(*attn), dt
        else:  # where x is rounded on one side only: a few bfloat16 steps of each output's scale apart
            for a, b in ((got, want), tuple(mlp)):
                atol = 1e-2 * b.float().abs().max().item() if dot else 1e-4
                torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=atol)


@pytest.mark.parametrize("arch", list(TARGETS))
def test_an_older_build_sums_interleaved_int8_codes_as_the_native_natural_ones(arch, native, tmp_path_factory):
    """qexact.h's interleaved groups on each build (512-bit multiply-adds without VNNI, two 256-bit halves on AVX2,
    scalar positions without vector units): decode and prefill, exact and wide, equal the native build's natural
    codes bit for bit."""
    from shardlm.quant import interleave_columns

    ext = _older_build(arch, tmp_path_factory)
    g = torch.Generator().manual_seed(12)
    for n, k in ((9, 1120), (6, 1536), (5, 992)):  # tails of 2 + 1, none, 8 + 4 + 2 + 1 blocks
        q8 = quantize_int8(torch.randn(n, k, generator=g))
        moved = interleave_columns(q8.q)
        x = torch.randn(20, k, generator=g)
        for rows in (1, 3, 20):
            for wide in (False, True):
                assert torch.equal(ext.gemv_int8(x[:rows], moved, q8.scale, True, wide, True),
                                   native.gemv_int8(x[:rows], q8.q, q8.scale, True, wide)), (n, k, rows, wide)
        assert torch.equal(ext.prefill_int8(x, moved, q8.scale, True, False, True),
                           native.prefill_int8(x, q8.q, q8.scale, True, False))
