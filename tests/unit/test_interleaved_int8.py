"""Interleaved int8 codes (csrc/qexact.h): the o and down projections' codes a CPU rank holds transposed in groups of
sixteen blocks (a row's tail in groups of 8, 4 and 2), so that their exact sums need no horizontal reduction a block.
The numbers must be the natural layout's bit for bit (decode and prefill, split and whole, every batch size), the
layout must reach exactly the weights that are summed exact and held in memory, and every path that reads codes some
other way must read them in natural order."""

from __future__ import annotations

import pytest
import torch

from refs import assert_same_products, int8_exact_reference, int8_weight
from shardlm.quant import Int8Weight, interleave_columns, interleave_groups, pack_int8

SHAPES = [(7, 576), (33, 1536), (5, 512), (9, 1120), (16, 32), (3, 2048), (4, 200), (6, 992), (5, 256), (2, 64)]
"""(rows, columns): one whole group and a tail of 2 blocks, three groups, one group exactly, two and a tail of 2 + 1,
one block, four groups, a tail alone (4 + 2 + 1), a group and a tail of every size (8 + 4 + 2 + 1), and tails alone
of 8 and of 2."""


@pytest.fixture(scope="module")
def ext(kernel_ext):
    return kernel_ext


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_order_transposes_chunks_in_each_group_and_is_its_own_inverse(n, k, ext):
    """Whole groups of 16 blocks, then the tail in groups of 8, 4 and 2 (a last odd block stays): in a group of m
    blocks, chunk t of block l (16 / m column pairs) at chunk position t m + l."""
    q = int8_weight(n, k, 1).q
    moved = interleave_columns(q)
    assert torch.equal(moved, ext.interleave_int8(q)), "the Python and C++ orders differ"
    assert torch.equal(interleave_columns(moved), q)
    blocks = q.shape[1] // 32
    groups = interleave_groups(blocks)
    assert [m for _, m in groups] == [16] * (blocks // 16) + [b for b in (8, 4, 2, 1) if blocks % 16 & b], groups
    assert [first for first, _ in groups] == [sum(m for _, m in groups[:i]) for i in range(len(groups))], groups
    for first, m in groups:
        cols = 32 // m  # a chunk's columns
        for l in range(m):
            for t in (0, m - 1, m // 2):
                at, was = 32 * first + cols * (t * m + l), 32 * (first + l) + cols * t
                assert torch.equal(moved[:, at:at + cols], q[:, was:was + cols]), (first, m, l, t)
    if any(m > 1 for _, m in groups):
        assert not torch.equal(moved, q)


@pytest.mark.parametrize("n,k", SHAPES)
def test_interleaved_exact_sums_are_the_natural_ones_bit_for_bit(n, k, ext):
    """gemv_int8 and prefill_int8, float32 and float64 (wide) out, 1 to 40 rows: the interleaved codes give the
    documented exact arithmetic (refs.int8_exact_reference) exactly as the natural ones do."""
    qw = int8_weight(n, k, 2)
    moved = interleave_columns(qw.q)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(3))
    want = int8_exact_reference(x, qw.q, qw.scale)
    for b in (1, 2, 5, 17, 40):
        assert torch.equal(ext.gemv_int8(x[:b], moved, qw.scale, exact=True, interleaved=True), want[:b]), b
        for kernel in (ext.gemv_int8, ext.prefill_int8):
            natural = kernel(x[:b], qw.q, qw.scale, exact=True, wide=True)
            assert torch.equal(kernel(x[:b], moved, qw.scale, exact=True, wide=True, interleaved=True), natural), b
            assert torch.equal(kernel(x[:b], moved, qw.scale, exact=True, interleaved=True),
                               kernel(x[:b], qw.q, qw.scale, exact=True)), (kernel, b)


def test_a_row_parallel_split_of_interleaved_weights_adds_up_to_the_whole(ext):
    """Two ranks' halves of a down projection (1536 columns: 768 each, one whole group and a tail apiece), each
    interleaved on its own, summed in float64: the one-rank result of the interleaved whole."""
    qw = int8_weight(24, 1536, 4)
    x = torch.randn(3, 1536, generator=torch.Generator().manual_seed(5))
    whole = ext.gemv_int8(x, interleave_columns(qw.q), qw.scale, exact=True, interleaved=True)
    parts = [ext.gemv_int8(x[:, c:c + 768], interleave_columns(qw.q[:, c:c + 768].contiguous()), qw.scale,
                           wide=True, interleaved=True) for c in (0, 768)]
    assert torch.equal((parts[0] + parts[1]).float(), whole)


def test_interleaved_codes_are_refused_where_a_float_sum_would_read_them(ext):
    qw = int8_weight(4, 576, 6)
    x = torch.randn(1, 576)
    for kernel in (ext.gemv_int8, ext.prefill_int8):
        with pytest.raises(RuntimeError, match="interleaved codes are summed exact only; pass exact=True"):
            kernel(x, interleave_columns(qw.q), qw.scale, interleaved=True)
    with pytest.raises(ValueError, match="only an exact int8 weight on the CPU"):
        qw.interleave()  # not flagged exact: its kernel sums in float lanes
    qw.exact = True
    qw.interleave()
    with pytest.raises(ValueError, match="not yet interleaved"):
        qw.interleave()


def test_every_reader_of_an_interleaved_weight_gets_the_natural_numbers(ext):
    """matmul_t through the kernels (decode and prefill rows) and without them (torch's int8 kernel on natural
    codes), and natural_q, on an interleaved weight equal the same weight left natural."""
    w = torch.randn(40, 600, generator=torch.Generator().manual_seed(7))
    plain, moved = pack_int8(*_codes(w)), pack_int8(*_codes(w))
    plain.exact = moved.exact = True
    moved.interleave()
    assert moved.interleaved and not torch.equal(moved.q, plain.q)
    assert torch.equal(moved.natural_q(), plain.q)
    assert_same_products(moved, plain, ext)


def _codes(w: torch.Tensor):
    from shardlm.quant import int8_codes

    return int8_codes(w)


def _logits_and_tokens(rank, prompts: list[list[int]]):
    from shardlm.runtime.protocol import SamplingParams
    from shardlm.runtime.step import Batch, attention_mask, generate, positions_for

    batch = Batch.from_lists(prompts)
    s = batch.tokens.shape[1]
    logits = rank(batch.tokens, positions_for(batch.valid), attention_mask(batch.valid, 0, s, None))
    return logits, generate(rank, batch, 12, SamplingParams(), ())


def _code_weights(rank):
    return {name: m.kernel_weight for name, m in rank.module.named_modules()
            if isinstance(getattr(m, "kernel_weight", None), Int8Weight)}


def test_a_rank_orders_its_resident_int8_weights_and_its_tokens_stay(bundled_dir, prompt64):
    """The bundled model in int8 on one rank (576 and 1536 columns: whole groups and tails): the o and down
    projections it holds in memory are interleaved, every other int8 weight (q, k, v, gate, up, and the tied head
    and embedding, once) is paired (csrc/qpairs.h); its prefill logits and greedy tokens (fused decode) equal those of
    the same rank with those codes put back in natural order."""
    from refs import build

    prompts = [prompt64[:40], prompt64[:23]]
    rank = build(bundled_dir, quantization="int8", quantize_embedding=True)
    weights = _code_weights(rank)
    moved = {name for name, kw in weights.items() if kw.interleaved}
    assert moved == {name for name in weights if name.endswith(("o_proj", "down_proj"))} and len(moved) == 60
    paired = {name for name, kw in weights.items() if kw.paired}
    assert paired == set(weights) - moved and len(paired) == 150 + 2, sorted(set(weights) - moved - paired)
    assert rank.module.lm_head.kernel_weight is rank.module.model.embed_tokens.kernel_weight
    got = _logits_and_tokens(rank, prompts)
    natural = build(bundled_dir, quantization="int8", quantize_embedding=True)
    for kw in {id(kw): kw for kw in _code_weights(natural).values()}.values():
        kw.q, kw.interleaved, kw.paired = kw.natural_q(), False, False
    want = _logits_and_tokens(natural, prompts)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_layers_streamed_from_disk_keep_natural_codes(bundled_dir, tmp_path):
    """With layers offloaded to disk, the streamed layers' weights come back from the store as they were written
    (natural order, neither interleaved nor paired) and the resident ones are interleaved or paired."""
    from refs import build

    rank = build(bundled_dir, quantization="int8", memory_budget=130 * 2**20, offload_dir=str(tmp_path))
    assert rank.streamed, "the budget should stream some layers"
    for name, kw in _code_weights(rank).items():
        if ".layers." in name:
            resident = int(name.split(".")[2]) not in rank.streamed
            exact = name.endswith(("o_proj", "down_proj"))
            assert (kw.interleaved, kw.paired) == (resident and exact, resident and not exact), name


def test_a_rank_on_torchs_kernels_keeps_natural_codes(bundled_dir):
    """Without our kernels (torch's int8 kernel reads natural codes) no weight is reordered, so no product turns
    its codes back first."""
    from refs import build
    from shardlm.settings import Settings

    rank = build(bundled_dir, quantization="int8", settings=Settings(kernels="torch"))
    weights = _code_weights(rank)
    assert weights and not any(kw.interleaved or kw.paired for kw in weights.values())
    assert any(kw.exact for kw in weights.values())
