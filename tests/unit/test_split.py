"""The slicing rules: every degree from 1 to the head count, nearly even, nothing lost."""

import pytest
from hypothesis import given, strategies as st

from shardlm.parallel.split import BLOCK, HeadSplit, block_range, split_range, split_sizes


@given(n=st.integers(1, 5000), parts=st.integers(1, 64))
def test_split_sizes_cover_and_differ_by_at_most_one(n, parts):
    if parts > n:
        with pytest.raises(ValueError, match="cannot split"):
            split_sizes(n, parts)
        return
    sizes = split_sizes(n, parts)
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    ranges = [split_range(n, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@given(n=st.integers(1, 30000), parts=st.integers(1, 64))
def test_block_ranges_cover_start_on_blocks_and_stay_nearly_even(n, parts):
    if parts > n:
        return  # split_range refuses it (above)
    ranges = [block_range(n, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    if n // BLOCK < parts:  # too few blocks: the plain split
        assert ranges == [split_range(n, parts, i) for i in range(parts)]
        return
    assert all(a % BLOCK == 0 for a, _ in ranges)
    whole = [(b - a) // BLOCK for a, b in ranges]
    assert max(whole) - min(whole) <= 1 and min(whole) >= 1


def test_mlp_widths_split_in_blocks():
    # llama-2-7b's 11008 at tp 3 (an even split would start ranks at 3670 and 7339, inside blocks)
    assert [block_range(11008, 3, r) for r in range(3)] == [(0, 3680), (3680, 7360), (7360, 11008)]
    assert [block_range(1536, 2, r) for r in range(2)] == [split_range(1536, 2, r) for r in range(2)]  # as before
    assert [block_range(200, 3, r) for r in range(3)] == [(0, 64), (64, 128), (128, 200)]


@given(kv=st.integers(1, 16), group=st.integers(1, 8), data=st.data())
def test_every_query_head_finds_its_kv_head(kv, group, data):
    heads = kv * group
    tp = data.draw(st.integers(1, heads))
    split = HeadSplit(heads, kv, tp)
    seen_q = []
    for r in range(tp):
        qa, qb = split.q_range(r)
        ka, kb = split.kv_range(r)
        kv_map = split.kv_map(r)
        assert len(kv_map) == qb - qa and kb - ka >= 1
        for local, h in enumerate(range(qa, qb)):
            assert ka + kv_map[local] == h // group  # the local KV head is the right global one
        seen_q.extend(range(qa, qb))
    assert seen_q == list(range(heads))


def test_bundled_shapes_split_as_documented():
    # SmolLM2: 9 heads, 3 KV heads. tp 2: q 5/4, KV head 1 replicated; tp 4: q 3/2/2/2.
    s2 = HeadSplit(9, 3, 2)
    assert [s2.q_range(r) for r in range(2)] == [(0, 5), (5, 9)]
    assert [s2.kv_range(r) for r in range(2)] == [(0, 2), (1, 3)]
    assert s2.kv_replicas() == 1
    s4 = HeadSplit(9, 3, 4)
    assert [s4.kv_range(r) for r in range(4)] == [(0, 1), (1, 2), (1, 3), (2, 3)]
    assert s4.kv_map(2) == [0, 1]


def test_tp_beyond_heads_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="use --tp 9 or fewer"):
        HeadSplit(9, 3, 10)
