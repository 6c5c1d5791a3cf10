"""Trust nothing on disk: every corruption and every containment escape is refused by name before use.

Each case damages a copy of a checkpoint made here (random weights, per-rank files written by
`shard`, an indexed folder written by `convert`) the way the fuzz run did, and checks that every
read path (the check before use, `generate`'s preparation, reshard, consolidate, shard, convert)
refuses it with a message naming the file and tensor, and that no write command leaves an output.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from shardlm.checkpoint.headers import INDEX_NAME, CheckpointError, weight_files
from shardlm.checkpoint.output import stale_siblings
from shardlm.checkpoint.shard import shard, write_whole
from shardlm.checkpoint.sharded import INFO_NAME
from shardlm.checkpoint.verify import check_before_use, verify
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.engine.session import GenerateRequest, UserError, prepare
from shardlm.plan.run import RunFlags

MB = 2**20
CONFIG = {**PRESETS["debug"], "num_hidden_layers": 4}


@pytest.fixture(autouse=True)
def _own_home(tmp_path, monkeypatch):
    """Each test remembers verified files in its own $SHARDLM_HOME, so no test trusts another's files."""
    monkeypatch.setenv("SHARDLM_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A plain HF folder, per-rank files for tp 2, and an indexed folder with checksums (convert)."""
    root = tmp_path_factory.mktemp("integrity")
    hf = write_random_checkpoint(CONFIG, root / "hf", seed=5)
    shard(hf, root / "ranks", 2, (), 256 * 1024, progress=False, verify="headers")
    write_whole(hf, root / "indexed", 256 * 1024, progress=False, verify="headers")
    return {"hf": hf, "ranks": root / "ranks", "indexed": root / "indexed"}


def _copy(made: dict, kind: str, tmp: Path) -> Path:
    dst = tmp / kind
    shutil.copytree(made[kind], dst)
    return dst


# --- forging helpers: change a header and, like a careful attacker, make the recorded checksums agree ----

def _read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + data)


def _rerecord(folder: Path) -> None:
    """Recompute every recorded size and sha256 (shardlm.json, or the index's shardlm_files)."""
    def rec(path: Path) -> dict:
        return {"bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}

    if (folder / INFO_NAME).is_file():
        doc = json.loads((folder / INFO_NAME).read_text())
        for r in doc["ranks"]:
            r["files"] = {name: rec(folder / r["dir"] / name) for name in r["files"]}
        (folder / INFO_NAME).write_text(json.dumps(doc))
    elif (folder / INDEX_NAME).is_file():
        index = json.loads((folder / INDEX_NAME).read_text())
        files = index["metadata"]["shardlm_files"]
        index["metadata"]["shardlm_files"] = {name: rec(folder / name) for name in files}
        (folder / INDEX_NAME).write_text(json.dumps(index))


def _file_with(folder: Path, part: str) -> tuple[Path, str]:
    """The first data file holding a tensor whose name contains `part`, and that name."""
    for f in sorted(folder.rglob("*.safetensors")):
        header, _ = _read_header(f)
        for name in header:
            if part in name:
                return f, name
    raise AssertionError(part)


def _flip_byte(folder: Path) -> None:
    f, _ = _file_with(folder, "mlp.up_proj")
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x01
    f.write_bytes(raw)


def _nan_in_q_proj(folder: Path) -> None:
    f, name = _file_with(folder, "q_proj")
    header, data = _read_header(f)
    start = header[name]["data_offsets"][0]
    data = bytearray(data)
    data[start:start + 4] = struct.pack("<f", float("nan"))
    _write_header(f, header, bytes(data))
    _rerecord(folder)


def _wrong_sha(folder: Path) -> None:
    doc = json.loads((folder / INFO_NAME).read_text())
    rec = next(v for k, v in doc["ranks"][1]["files"].items() if k.endswith(".safetensors"))
    rec["sha256"] = "0" * 64
    (folder / INFO_NAME).write_text(json.dumps(doc))


def _relabel_f32_as_i32(folder: Path) -> None:
    f, name = _file_with(folder, "k_proj")
    header, data = _read_header(f)
    header[name]["dtype"] = "I32"
    _write_header(f, header, data)
    _rerecord(folder)


def _share_bytes(folder: Path) -> None:
    """Point one tensor's data_offsets at another's bytes (same length, so dtype x shape still agrees)."""
    for f in sorted(folder.rglob("*.safetensors")):
        header, data = _read_header(f)
        by_len: dict[int, list[str]] = {}
        for k, v in header.items():
            if k != "__metadata__":
                by_len.setdefault(v["data_offsets"][1] - v["data_offsets"][0], []).append(k)
        pair = next((names for names in by_len.values() if len(names) > 1), None)
        if pair:
            header[pair[1]]["data_offsets"] = list(header[pair[0]]["data_offsets"])
            _write_header(f, header, data)
            _rerecord(folder)
            return
    raise AssertionError("no two tensors of one length in one file")


def _swap_shape(folder: Path) -> None:
    # a non-square slice (at tp 2 the debug shape's rank 0 holds a 96 x 96 block of down_proj, whose swap is no change)
    for f in sorted(folder.rglob("*.safetensors")):
        header, data = _read_header(f)
        name = next((n for n in header if "mlp.down_proj" in n and len(set(header[n]["shape"])) == 2), None)
        if name:
            break
    else:
        raise AssertionError("no non-square down_proj slice to alter")
    header[name]["shape"] = header[name]["shape"][::-1]
    _write_header(f, header, data)
    _rerecord(folder)


def _edit_tp(folder: Path) -> None:
    doc = json.loads((folder / INFO_NAME).read_text())
    doc["layout"]["tp"] = 3
    (folder / INFO_NAME).write_text(json.dumps(doc))


def _edit_stages(folder: Path) -> None:
    doc = json.loads((folder / INFO_NAME).read_text())
    doc["layout"]["stage_layers"] = [[0, 3]]
    (folder / INFO_NAME).write_text(json.dumps(doc))


# kind, damage, what the refusal must say
CORRUPTIONS = {
    "ranks-flipped-byte": ("ranks", _flip_byte, "does not match the sha256"),
    "ranks-nan-in-q_proj": ("ranks", _nan_in_q_proj, "holds NaN or Inf"),
    "ranks-wrong-sha256": ("ranks", _wrong_sha, "does not match the sha256"),
    "ranks-f32-as-i32": ("ranks", _relabel_f32_as_i32, "is stored as I32"),
    "ranks-shared-bytes": ("ranks", _share_bytes, "share bytes"),
    "ranks-swapped-shape": ("ranks", _swap_shape, "the header was altered"),
    "ranks-edited-tp": ("ranks", _edit_tp, "lists 2 ranks but tp 3"),
    "ranks-edited-stages": ("ranks", _edit_stages, "layout.stage_layers end at layer 3"),
    "indexed-flipped-byte": ("indexed", _flip_byte, "does not match the sha256"),
    "indexed-f32-as-i32": ("indexed", _relabel_f32_as_i32, "is stored as I32"),
    "hf-nan-in-q_proj": ("hf", lambda d: _nan_in_q_proj_plain(d), "holds NaN or Inf"),
    "hf-f32-as-i32": ("hf", _relabel_f32_as_i32, "is stored as I32"),
    "hf-shared-bytes": ("hf", _share_bytes, "share bytes"),
    "hf-swapped-shape": ("hf", _swap_shape, "config.json implies"),
}


def _nan_in_q_proj_plain(folder: Path) -> None:
    f, name = _file_with(folder, "q_proj")
    header, data = _read_header(f)
    start = header[name]["data_offsets"][0]
    data = bytearray(data)
    data[start + 8:start + 12] = struct.pack("<f", float("inf"))
    _write_header(f, header, bytes(data))


def _reads(kind: str, src: Path, out: Path) -> list:
    """Every read path that takes this kind of checkpoint, as callables that must refuse it."""
    paths = [lambda: check_before_use(src),
             lambda: prepare(GenerateRequest(["x"]), str(src), RunFlags(tp=2 if kind == "ranks" else 1), {"tp"})]
    if kind == "ranks":
        paths += [lambda: shard(src, out, 1, (), MB, progress=False),            # reshard
                  lambda: write_whole(src, out, MB, progress=False)]              # consolidate
    else:
        paths += [lambda: shard(src, out, 2, (), MB, progress=False),            # shard
                  lambda: write_whole(src, out, MB, progress=False)]              # convert
    return paths


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corruption_is_refused_by_name_on_every_read_path(made, tmp_path, case):
    kind, damage, expect = CORRUPTIONS[case]
    src = _copy(made, kind, tmp_path)
    check_before_use(src)  # sound before the damage, and remembered as verified: the damage must still show
    damage(src)
    for i, read in enumerate(_reads(kind, src, tmp_path / "out")):
        with pytest.raises((CheckpointError, UserError), match=expect) as e:
            read()
        assert str(src) in str(e.value), (i, str(e.value))
        assert not (tmp_path / "out").exists() and not stale_siblings(tmp_path / "out"), i
    assert not verify(src).ok


def test_plain_folder_says_there_is_nothing_to_compare_against(made, tmp_path):
    src = _copy(made, "hf", tmp_path)
    rep = verify(src)
    assert rep.ok and rep.files == 1 and rep.bytes > 0
    assert "no checksums recorded: there is nothing to compare the data against" in rep.checked
    assert "headers checked fully" in rep.checked
    _flip_byte(src)  # a flipped mantissa bit stays a finite float: nothing on disk can tell
    assert verify(src).ok
    _share_bytes(src)
    assert any("share bytes" in p for p in verify(src, checksums=False).problems)


def test_changed_mode_rehashes_only_changed_files(made, tmp_path):
    src = _copy(made, "ranks", tmp_path)
    first = verify(src, mode="changed")
    assert first.ok and "read now" not in first.checked
    again = verify(src, mode="changed")
    assert again.ok and f"{len(again.content)} unchanged since verified on this machine, 0 read now" in again.checked
    _flip_byte(src)
    assert any("sha256" in p for p in verify(src, mode="changed").problems)
    assert verify(src, mode="headers").ok  # headers only: the flipped byte is not read


def test_unknown_verify_mode_is_refused(made):
    with pytest.raises(CheckpointError, match="--verify quick is not a mode; use one of full, changed"):
        check_before_use(made["hf"], "quick")


# --- containment -----------------------------------------------------------------------------------------

def _outside_copy(src: Path, tmp: Path) -> Path:
    """A perfectly valid data file outside the checkpoint (what an escaping name would point at)."""
    f, _ = _file_with(src, "")
    outside = tmp / "outside"
    outside.mkdir(exist_ok=True)
    return Path(shutil.copy(f, outside / f.name))


def _index_points_to(value: str):
    def damage(folder: Path, tmp: Path) -> None:
        if not (folder / INDEX_NAME).is_file():  # make the plain folder an indexed one
            header, _ = _read_header(folder / "model.safetensors")
            (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {
                k: "model.safetensors" for k in header if k != "__metadata__"}}))
        index = json.loads((folder / INDEX_NAME).read_text())
        name = next(iter(index["weight_map"]))
        index["weight_map"][name] = value.format(outside=_outside_copy(folder, tmp))
        (folder / INDEX_NAME).write_text(json.dumps(index))
    return damage


def _symlink_data_file(folder: Path, tmp: Path) -> None:
    f, _ = _file_with(folder, "")
    outside = _outside_copy(folder, tmp)
    f.unlink()
    f.symlink_to(outside)


def _symlink_config(folder: Path, tmp: Path) -> None:
    outside = tmp / "outside" / "config.json"
    outside.parent.mkdir(exist_ok=True)
    shutil.copy(folder / "config.json", outside)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside)


def _symlink_tokenizer(folder: Path, tmp: Path) -> None:
    (folder / "tokenizer.json").symlink_to("/etc/passwd")


def _rank_dir_outside(folder: Path, tmp: Path) -> None:
    shutil.copytree(folder / "rank-00001", tmp / "elsewhere")
    doc = json.loads((folder / INFO_NAME).read_text())
    doc["ranks"][1]["dir"] = "../elsewhere"
    (folder / INFO_NAME).write_text(json.dumps(doc))


def _rank_file_absolute(folder: Path, tmp: Path) -> None:
    outside = _outside_copy(folder, tmp)
    doc = json.loads((folder / INFO_NAME).read_text())
    files = doc["ranks"][0]["files"]
    name = next(k for k in files if k.endswith(".safetensors"))
    files[str(outside)] = files.pop(name)
    (folder / INFO_NAME).write_text(json.dumps(doc))


def _rank_index_escapes(folder: Path, tmp: Path) -> None:
    _index_points_to("../../outside/{outside.name}")(folder / "rank-00000", tmp)


ESCAPES = {
    "hf-index-absolute": ("hf", _index_points_to("{outside}"), "an absolute path"),
    "hf-index-etc-passwd": ("hf", _index_points_to("/etc/passwd"), "an absolute path"),
    "hf-index-dotdot": ("hf", _index_points_to("../outside/{outside.name}"), "climbs out"),
    "hf-index-deep-dotdot": ("hf", _index_points_to("../../../../../../etc/passwd"), "climbs out"),
    "hf-symlinked-weights": ("hf", _symlink_data_file, "outside"),
    "hf-symlinked-config": ("hf", _symlink_config, "outside"),
    "hf-symlinked-tokenizer": ("hf", _symlink_tokenizer, "is a symlink to /etc/passwd"),
    "indexed-index-dotdot": ("indexed", _index_points_to("../outside/{outside.name}"), "climbs out"),
    "ranks-dir-outside": ("ranks", _rank_dir_outside, "climbs out"),
    "ranks-file-absolute": ("ranks", _rank_file_absolute, "an absolute path"),
    "ranks-symlinked-weights": ("ranks", _symlink_data_file, "outside"),
    "ranks-index-escapes": ("ranks", _rank_index_escapes, "climbs out"),
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_names_leaving_the_folder_are_refused_before_opening(made, tmp_path, case):
    kind, damage, expect = ESCAPES[case]
    src = _copy(made, kind, tmp_path)
    damage(src, tmp_path)
    for i, read in enumerate(_reads(kind, src, tmp_path / "out")):
        with _watch_opens() as opened:
            with pytest.raises((CheckpointError, UserError)) as e:
                read()
        assert expect in str(e.value), (i, str(e.value))
        outside = [p for p in opened if p.startswith(str(tmp_path / "outside")) or p == "/etc/passwd"]
        if case == "hf-symlinked-config" and i == 1:  # generate reads config.json to find the model (see note)
            outside = [p for p in outside if not p.endswith("config.json")]
        assert not outside, (i, outside)
        assert not (tmp_path / "out").exists() and not stale_siblings(tmp_path / "out"), i


@contextlib.contextmanager
def _watch_opens():
    """Record the real path of every file opened (os.open and the built-in open) inside the block."""
    opened: list[str] = []
    real_os_open, real_io_open = os.open, io.open

    def os_spy(path, *a, **kw):
        opened.append(os.path.realpath(path))
        return real_os_open(path, *a, **kw)

    def io_spy(file, *a, **kw):
        if isinstance(file, (str, bytes, os.PathLike)):
            opened.append(os.path.realpath(file))
        return real_io_open(file, *a, **kw)

    os.open, io.open, builtins.open = os_spy, io_spy, io_spy
    try:
        yield opened
    finally:
        os.open, io.open, builtins.open = real_os_open, real_io_open, real_io_open


@pytest.mark.parametrize("case", ["hf-index-absolute", "hf-index-dotdot", "hf-symlinked-weights"])
def test_readers_refuse_escapes_without_the_check_before_use(made, tmp_path, case):
    kind, damage, expect = ESCAPES[case]
    src = _copy(made, kind, tmp_path)
    damage(src, tmp_path)
    with pytest.raises(CheckpointError, match=expect):
        weight_files(src)
    with pytest.raises(CheckpointError, match=expect):
        write_whole(src, tmp_path / "out", MB, progress=False, verify="none")
    assert not (tmp_path / "out").exists()


def test_hub_cache_snapshot_symlinks_into_blobs_are_followed(made, tmp_path):
    repo = tmp_path / "models--org--name"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in made["hf"].iterdir():
        blob = blobs / hashlib.sha256(f.name.encode()).hexdigest()
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    check_before_use(snap)
    write_whole(snap, tmp_path / "out", MB, progress=False)
    assert verify(tmp_path / "out").ok and not (tmp_path / "out" / "config.json").is_symlink()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_nan_scan_counts_exactly_in_every_float_width(tmp_path, dtype):
    import torch

    from shardlm.checkpoint.integrity import scan_file
    from shardlm.checkpoint.writer import Entry, write_file

    dt = getattr(torch, dtype)
    ones = torch.ones(100_000, dtype=dt)  # its float16 sum overflows: that alone must not count as Inf
    bad = torch.zeros(1000, dtype=dt)
    bad[3], bad[7], bad[9] = float("nan"), float("inf"), float("-inf")
    path = tmp_path / "x.safetensors"
    rec = write_file(path, [Entry("ones", dt, (100_000,), lambda: ones), Entry("bad", dt, (1000,), lambda: bad)])
    res = scan_file(path)
    assert res.nonfinite == {"bad": 3} and res.sha256 == rec["sha256"]
