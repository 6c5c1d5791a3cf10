"""Rank processes start with glibc's malloc asking for transparent huge pages (settings.huge_page_children), and
the starting process's environment is left as it was."""

import multiprocessing as mp
import os

import pytest

from shardlm.settings import Settings, huge_page_children


def _tunables(out) -> None:
    """In the child: its GLIBC_TUNABLES as it started."""
    out.put(os.environ.get("GLIBC_TUNABLES"))


@pytest.mark.parametrize("before,want", [(None, "glibc.malloc.hugetlb=1"),
                                         ("glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0",
                                          "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")])
def test_ranks_start_with_malloc_asking_for_huge_pages(before, want, monkeypatch):
    """A process started inside huge_page_children(True) runs glibc's malloc with hugetlb=1, other tunables kept
    and an earlier hugetlb replaced; the starting process's environment is as it was afterwards, and (False)
    nothing changes."""
    if before is None:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    else:
        monkeypatch.setenv("GLIBC_TUNABLES", before)
    ctx = mp.get_context("spawn")
    for on, expect in ((True, want), (False, before)):
        out = ctx.Queue()
        child = ctx.Process(target=_tunables, args=(out,), daemon=True)
        with huge_page_children(on):
            child.start()
        try:
            assert out.get(timeout=60) == expect
        finally:
            child.join(timeout=30)
        assert os.environ.get("GLIBC_TUNABLES") == before


def test_huge_pages_are_on_unless_the_environment_turns_them_off():
    assert Settings.from_env({}).huge_pages
    assert not Settings.from_env({"SHARDLM_HUGE_PAGES": "0"}).huge_pages
