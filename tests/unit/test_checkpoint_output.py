"""All-or-nothing outputs: a refused, failed, interrupted or full-disk write leaves no output (or the old one)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shardlm import atomic
from shardlm.checkpoint import writer
from shardlm.checkpoint.headers import CheckpointError
from shardlm.checkpoint.output import stale_siblings
from shardlm.checkpoint.shard import shard, write_whole
from shardlm.checkpoint.sharded import INFO_NAME, read_info
from shardlm.checkpoint.verify import verify
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint

MB = 2**20
CONFIG = {**PRESETS["debug"], "num_hidden_layers": 4}
TINY = {**PRESETS["debug"], "num_hidden_layers": 1}


@pytest.fixture(autouse=True)
def _own_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLM_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    hf = write_random_checkpoint(CONFIG, root / "hf", seed=7)
    (hf / "tokenizer.json").write_text("{}")
    (hf / "chat_template.jinja").write_text("{{ messages }}")
    (hf / "generation_config.json").write_text("{}")
    shard(hf, root / "ranks", 2, (), 128 * 1024, progress=False)
    return {"hf": hf, "ranks": root / "ranks"}


COMMANDS = {  # name -> (source kind, call writing `out`)
    "shard": ("hf", lambda src, out, **kw: shard(src, out, 2, (), 128 * 1024, progress=False, **kw)),
    "reshard": ("ranks", lambda src, out, **kw: shard(src, out, 3, (), 128 * 1024, progress=False, **kw)),
    "consolidate": ("ranks", lambda src, out, **kw: write_whole(src, out, 128 * 1024, progress=False, **kw)),
    "convert": ("hf", lambda src, out, **kw: write_whole(src, out, 128 * 1024, progress=False, **kw)),
}


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _fail_after(n: int, exc: BaseException):
    """A writer.write_file that writes `n` files, then raises `exc` (a disk filling up, a Ctrl-C)."""
    real, calls = writer.write_file, []

    def write_file(path, entries, on_bytes=None):
        calls.append(path)
        if len(calls) > n:
            raise exc
        return real(path, entries, on_bytes)
    return write_file


FAILURES = {
    "full-disk": (lambda: OSError(errno.ENOSPC, "No space left on device"), CheckpointError, "No space left on device: "),
    "ctrl-c": (lambda: KeyboardInterrupt(), KeyboardInterrupt, None),
    "bug": (lambda: RuntimeError("boom"), RuntimeError, "boom"),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_a_write_that_fails_midway_leaves_nothing(sources, tmp_path, monkeypatch, command, failure, existing):
    kind, write = COMMANDS[command]
    make, raised, says = FAILURES[failure]
    out = tmp_path / "deep" / "out"
    before = None
    if existing:
        write(sources[kind], out)
        (out / "notes.txt").write_text("mine")
        before = _tree(out)
    monkeypatch.setattr(writer, "write_file", _fail_after(2, make()))
    with pytest.raises(raised, match=says) as e:
        write(sources[kind], out, overwrite=existing)
    if existing:
        assert _tree(out) == before and verify(out).ok  # the old checkpoint, untouched
    else:
        assert not out.exists() and not out.parent.exists()  # not even the parent it created
    assert not stale_siblings(out)
    if failure == "full-disk":
        assert str(out) in str(e.value) and "nothing was written" in str(e.value)
        assert ".shardlm-tmp-" not in str(e.value)  # the path as the user named it
    monkeypatch.undo()
    write(sources[kind], out, overwrite=existing)  # a rerun needs no --overwrite when there was nothing
    assert verify(out).ok
    assert (out / "notes.txt").read_text() == "mine" if existing else True


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_metadata_commits_with_the_weights(sources, tmp_path, command):
    kind, write = COMMANDS[command]
    out = tmp_path / "out"
    write(sources[kind], out)
    for name in ("config.json", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).is_file(), name
    assert oct(out.stat().st_mode & 0o777) == "0o755"


def test_stale_build_folders_are_swept_and_live_ones_kept(sources, tmp_path):
    out = tmp_path / "out"
    dead = tmp_path / ".out.shardlm-tmp-999999-abcd"
    (dead / "rank-00000").mkdir(parents=True)
    (dead / "rank-00000" / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    live, fd = atomic.new_sibling_folder(out)  # held by this (live) process
    try:
        shard(sources["hf"], out, 2, (), MB, progress=False)
        assert not dead.exists() and live.exists() and verify(out).ok
    finally:
        os.close(fd)
    assert atomic.sweep_siblings(out) == [live] and not stale_siblings(out)


def test_plain_renames_where_exchange_is_unsupported(sources, tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_renameat2", lambda src, dst, flags: False)
    out = tmp_path / "out"
    shard(sources["hf"], out, 2, (), MB, progress=False)
    shard(sources["hf"], out, 3, (), MB, progress=False, overwrite=True)
    assert read_info(out).tp == 3 and verify(out).ok and not stale_siblings(out)
    # killed between its two renames: the old folder waits beside the target, the next run puts it back
    os.rename(out, tmp_path / ".out.shardlm-old-999999")
    atomic.sweep_siblings(out)
    assert read_info(out).tp == 3 and not stale_siblings(out)


def test_refusals_come_before_any_output(sources, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("y")
    with pytest.raises(CheckpointError, match="not empty .* --overwrite"):
        shard(sources["hf"], out, 2, (), MB, progress=False)
    with pytest.raises(CheckpointError, match="overlaps the input"):
        shard(sources["hf"], sources["hf"] / "inner", 2, (), MB, progress=False)
    assert not (sources["hf"] / "inner").exists() and not stale_siblings(out)
    empty = tmp_path / "empty"
    empty.mkdir()
    shard(sources["hf"], empty, 2, (), MB, progress=False)  # an empty folder is filled without --overwrite
    assert verify(empty).ok


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB tmpfs (needs root and mount rights; skipped otherwise)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_really_full_disk(sources, tmp_path, small_disk):
    out = small_disk / "out"
    with pytest.raises(CheckpointError, match=r"No space left on device: .*disk/out/.* nothing was written "
                                              r"\(.*out was not created\)") as e:
        shard(sources["hf"], out, 2, (), 256 * 1024, progress=False)  # ~2 MB into 1.5 MB
    assert "MB had been written when the disk" in str(e.value)
    assert not out.exists() and not stale_siblings(out) and not any(small_disk.iterdir())
    tiny = write_random_checkpoint(TINY, tmp_path / "tiny", seed=1)
    shard(tiny, out, 1, (), MB, dtype="bfloat16", progress=False)  # ~0.5 MB fits
    before = _tree(out)
    with pytest.raises(CheckpointError, match=f"{out} is unchanged"):
        shard(sources["hf"], out, 2, (), 256 * 1024, progress=False, overwrite=True)
    assert _tree(out) == before and verify(out).ok and not stale_siblings(out)
    with pytest.raises(OSError) as e:  # single files (plan -o, calibration) name their path too
        with atomic.atomic_file(small_disk / "big.yaml", "wb") as f:
            f.write(b"x" * 2 * MB)
    assert e.value.filename == str(small_disk / "big.yaml") and not list(small_disk.glob(".big.yaml.*"))


def test_shardlm_json_is_inside_the_commit(sources, tmp_path):
    out = tmp_path / "out"
    shard(sources["hf"], out, 2, (), MB, progress=False)
    doc = json.loads((out / INFO_NAME).read_text())
    assert [r["dir"] for r in doc["ranks"]] == ["rank-00000", "rank-00001"]
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
