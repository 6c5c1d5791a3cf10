"""Paired int8 codes (csrc/qpairs.h): the weights summed in float lanes (q, k, v, gate, up, a quantized head) a CPU
rank holds with each pair of blocks' 16-column halves exchanged, so that a 512-bit build sums two blocks with one
multiply-add. The numbers must be the natural order's bit for bit (decode and prefill, every batch size, an odd last
block), the order must be refused where a sum is exact, and every path that reads codes some other way (torch's
kernel, the embedding lookup, the greedy run's head and embedding) must read them in natural order. Which weights a
rank pairs: tests/unit/test_interleaved_int8.py; the greedy run on a paired head and embedding:
tests/unit/test_greedy_run.py."""

from __future__ import annotations

import pytest
import torch

from refs import assert_same_products, int8_weight
from shardlm.quant import Int8Embedding, pair_columns

SHAPES = [(7, 576), (33, 1536), (5, 544), (9, 32), (16, 64), (3, 96), (301, 577), (4, 200)]
"""(rows, columns): 9 and 24 pairs of blocks (the bundled model's widths), 8 pairs and an odd last block, one block
alone, one pair, a pair and a block, 18 pairs and a padded odd block, 3 pairs and a padded odd block."""


@pytest.fixture(scope="module")
def ext(kernel_ext):
    return kernel_ext


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_order_exchanges_the_middle_halves_of_each_pair_and_is_its_own_inverse(n, k, ext):
    q = int8_weight(n, k, 1).q
    moved = pair_columns(q)
    assert torch.equal(moved, ext.pair_int8(q)), "the Python and C++ orders differ"
    assert torch.equal(pair_columns(moved), q)
    kp = q.shape[1]
    for c in range(kp):  # column c of block 2p + l, half h, sits at half 2h + l of its pair (an odd last block stays)
        pair, i = divmod(c, 64)
        at = c if (pair + 1) * 64 > kp else pair * 64 + (i % 32) // 16 * 32 + i // 32 * 16 + i % 16
        assert torch.equal(moved[:, at], q[:, c]), c


@pytest.mark.parametrize("n,k", SHAPES)
def test_paired_float_sums_are_the_natural_ones_bit_for_bit(n, k, ext):
    """gemv_int8's float lanes and prefill_int8's panels on paired codes equal those on natural codes, at batch sizes
    that take the 512-bit build's one-row loop (1), its 4 x 2 tiles (2, 4, 16) and one-row tiles (3, 5)."""
    qw = int8_weight(n, k, 2)
    moved = pair_columns(qw.q)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(3))
    for b in (1, 2, 3, 4, 5, 16):
        assert torch.equal(ext.gemv_int8(x[:b], moved, qw.scale, paired=True), ext.gemv_int8(x[:b], qw.q, qw.scale)), b
        assert torch.equal(ext.prefill_int8(x[:b], moved, qw.scale, paired=True),
                           ext.prefill_int8(x[:b], qw.q, qw.scale)), b


def test_paired_codes_are_refused_where_an_exact_sum_would_read_them(ext):
    qw = int8_weight(4, 576, 6)
    x = torch.randn(1, 576)
    for kernel in (ext.gemv_int8, ext.prefill_int8):
        for flags in ({"exact": True}, {"wide": True}, {"interleaved": True, "exact": True}):
            with pytest.raises(RuntimeError, match="paired codes are summed in float lanes only"):
                kernel(x, pair_columns(qw.q), qw.scale, paired=True, **flags)
    qw.exact = True
    with pytest.raises(ValueError, match="summed in float lanes \\(not exact\\)"):
        qw.pair()
    qw.exact = False
    qw.pair()
    with pytest.raises(ValueError, match="not yet paired"):
        qw.pair()


def test_every_reader_of_a_paired_weight_gets_the_natural_numbers(ext):
    """matmul_t through the kernels (decode rows and prefill panels) and without them (torch's int8 kernel on
    natural codes), natural_q, natural_rows and an Int8Embedding's lookup, on a paired weight, equal the same weight
    left natural."""
    plain, moved = int8_weight(40, 600, 7), int8_weight(40, 600, 7)
    moved.pair()
    assert moved.paired and not torch.equal(moved.q, plain.q)
    assert torch.equal(moved.natural_q(), plain.q)
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(moved.natural_rows(ids), plain.q[ids])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(Int8Embedding(moved, dtype)(ids), Int8Embedding(plain, dtype)(ids))
    assert_same_products(moved, plain, ext)
