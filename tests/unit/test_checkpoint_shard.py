"""Per-rank files, resharding, consolidation and conversion: bitwise round trips, size caps, verify, bad input."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardlm.checkpoint.shard import shard, write_whole
from shardlm.checkpoint.sharded import INFO_NAME, check_layout, read_info
from shardlm.checkpoint.headers import CheckpointError
from shardlm.checkpoint.verify import verify
from shardlm.models.args import read_config
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.models.registry import args_for_config
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.stages import StageSpec, stages_from_counts
from refs import plan_for
from shardlm.runtime.build import build_rank_model
from shardlm.settings import Settings

MB = 2**20
# 12 heads / 4 KV heads, vocab 1001, 4 layers, untied; and a tied variant
UNTIED = {**PRESETS["debug"], "num_hidden_layers": 4}
TIED = {**UNTIED, "tie_word_embeddings": True, "num_attention_heads": 6, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_models")
    return {"untied": write_random_checkpoint(UNTIED, root / "untied", seed=3),
            "tied": write_random_checkpoint(TIED, root / "tied", seed=4)}


def _rank_params(folder: Path, tp: int, counts: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """Every rank's parameters as the runtime loads them from `folder` (in this process)."""
    plan, source = plan_for(folder, tp=tp, pp=len(counts), layers=counts if len(counts) > 1 else None)
    out = []
    for rank in range(plan.world):
        spec = plan.rank_spec(rank)
        model = build_rank_model(spec, source, ParallelContext(rank=spec.tp_rank, world=tp), Settings(kernels="torch"))
        out.append({n: p.detach().clone() for n, p in model.module.named_parameters()})
    return out


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for rank, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), rank
        for n in x:
            assert torch.equal(x[n], y[n]), f"rank {rank} {n}"


def _data_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.safetensors"))


@pytest.mark.parametrize("name", ["untied", "tied"])
@pytest.mark.parametrize("tp,counts", [(2, (4,)), (3, (4,)), (2, (2, 2)), (1, (1, 3))])
def test_per_rank_files_load_bitwise_like_slicing(models, tmp_path, name, tp, counts):
    src = models[name]
    shard(src, tmp_path / "out", tp, stages_from_counts(counts), 64 * 1024, progress=False)
    assert verify(tmp_path / "out").ok
    _assert_same(_rank_params(tmp_path / "out", tp, counts), _rank_params(src, tp, counts))
    assert all(f.stat().st_size < 64 * 1024 + 4096 or len(json.loads(f.read_bytes()[8:8 + struct.unpack("<Q", f.read_bytes()[:8])[0]])) == 2
               for f in _data_files(tmp_path / "out")), "a file holding several tensors exceeds the cap"


@pytest.mark.parametrize("before,after", [
    ((4, (4,)), (2, (4,))),        # tp 4 -> 2
    ((2, (4,)), (3, (4,))),        # tp 2 -> 3
    ((2, (2, 2)), (3, (4,))),      # tp 2 x pp 2 -> tp 3
    ((3, (1, 3)), (1, (4,))),      # any -> tp 1
    ((1, (4,)), (5, (3, 1))),      # tp 1 -> tp 5 x pp 2, uneven heads and stages
])
def test_reshard_gives_what_slicing_gives(models, tmp_path, before, after):
    src = models["untied"]
    shard(src, tmp_path / "a", before[0], stages_from_counts(before[1]), MB, progress=False)
    shard(tmp_path / "a", tmp_path / "b", after[0], stages_from_counts(after[1]), MB, progress=False)
    assert verify(tmp_path / "b").ok
    assert read_info(tmp_path / "b").source["identity"] == read_info(tmp_path / "a").source["identity"]
    _assert_same(_rank_params(tmp_path / "b", *after), _rank_params(src, *after))


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_consolidate_returns_the_original_tensors_and_transformers_loads_it(models, tmp_path, name):
    from transformers import AutoModelForCausalLM

    src = models[name]
    shard(src, tmp_path / "a", 5, stages_from_counts((3, 1)), MB, progress=False)
    write_whole(tmp_path / "a", tmp_path / "hf", 100 * 1024, progress=False)
    assert verify(tmp_path / "hf").ok
    orig = load_file(str(src / "model.safetensors"))
    back = {}
    for f in _data_files(tmp_path / "hf"):
        back.update(load_file(str(f)))
    assert back.keys() == orig.keys() and all(torch.equal(orig[k], back[k]) for k in orig)
    ids = torch.tensor([[5, 17, 300, 2, 9]])
    ref = AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    assert torch.equal(ref, got)


def test_convert_caps_files_writes_an_index_and_casts(models, tmp_path):
    write_whole(models["untied"], tmp_path / "c", 200 * 1024, dtype="bfloat16", progress=False)
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
    files = _data_files(tmp_path / "c")
    assert len(files) > 3 and set(index["weight_map"].values()) == {f.name for f in files}
    assert all(t.dtype == torch.bfloat16 for f in files for t in load_file(str(f)).values())
    assert verify(tmp_path / "c").ok


def _break(folder: Path, how: str) -> None:
    f = _data_files(folder)[0]
    raw = bytearray(f.read_bytes())
    if how == "truncate":
        f.write_bytes(raw[: len(raw) - 100])
    elif how == "flip":
        raw[-1] ^= 0xFF
        f.write_bytes(raw)
    elif how == "missing":
        f.unlink()
    elif how == "slice":
        index = folder / "rank-00001" / "model.safetensors.index.json"
        doc = json.loads(index.read_text())
        rec = next(iter(v for k, v in doc["metadata"]["shardlm_slices"].items() if "q_proj" in k))
        rec["slices"][0] = [0, rec["slices"][0][1] - rec["slices"][0][0]]
        index.write_text(json.dumps(doc))


@pytest.mark.parametrize("how,expect", [
    ("truncate", "were written (truncated or replaced)"),
    ("flip", "sha256"),
    ("missing", "is missing"),
    ("slice", "the layout needs"),
])
def test_verify_names_the_damage(models, tmp_path, how, expect):
    shard(models["untied"], tmp_path / "a", 2, (), 256 * 1024, progress=False)
    _break(tmp_path / "a", how)
    rep = verify(tmp_path / "a")
    assert not rep.ok and any(expect in p for p in rep.problems), rep.problems


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _lie_about_offsets(path: Path) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _missing_tensor(path: Path) -> None:
    t = load_file(str(path))
    del t["model.layers.1.mlp.up_proj.weight"]
    from safetensors.torch import save_file
    save_file(t, str(path), metadata={"format": "pt"})


def _wrong_config(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("damage,expect", [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]), "truncated"),
    (lambda d: _lie_about_offsets(d / "model.safetensors"), "lies about offsets"),
    (lambda d: _missing_tensor(d / "model.safetensors"), "model.layers.1.mlp.up_proj.weight"),
    (_wrong_config, "implies"),
])
def test_bad_sources_are_refused_before_anything_is_written(models, tmp_path, damage, expect):
    src = _copy_model(models["untied"], tmp_path / "src")
    damage(src)
    with pytest.raises(CheckpointError, match=expect) as e:
        shard(src, tmp_path / "out", 2, (), MB, progress=False)
    assert str(src) in str(e.value)  # names the file or the folder
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_output_folder_rules(models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty .* --overwrite"):
        shard(models["untied"], out, 2, (), MB, progress=False)
    shard(models["untied"], out, 2, (), MB, overwrite=True, progress=False)
    shard(models["untied"], out, 3, (), MB, overwrite=True, progress=False)  # replaces the tp 2 files
    assert (out / "notes.txt").read_text() == "mine" and not (out / "rank-00003").exists()
    assert read_info(out).tp == 3 and verify(out).ok
    with pytest.raises(CheckpointError, match="overlaps the input"):
        shard(out, out / "inner", 2, (), MB, progress=False)


def test_runtime_refuses_files_for_another_layout(models, tmp_path):
    shard(models["untied"], tmp_path / "a", 2, (), MB, progress=False)
    with pytest.raises(CheckpointError, match="tp 2 x pp 1 .* this run is tp 3"):
        check_layout(tmp_path / "a", 3, (), 4)
    (tmp_path / "a" / INFO_NAME).unlink()
    with pytest.raises(CheckpointError, match="interrupted write"):
        read_info(tmp_path / "a")


def test_random_checkpoint_streams_into_capped_files_with_the_same_values(models, tmp_path):
    capped = write_random_checkpoint(UNTIED, tmp_path / "capped", seed=3, max_shard_bytes=MB // 4)
    index = json.loads((capped / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (capped / "model.safetensors").exists()
    whole = load_file(str(models["untied"] / "model.safetensors"))
    parts = {}
    for f in files:
        part = load_file(str(capped / f))
        # a file exceeds the cap only when one tensor alone does
        assert (capped / f).stat().st_size <= MB // 4 + 4096 or len(part) == 1, f
        parts.update(part)
    assert parts.keys() == whole.keys()
    assert all(torch.equal(parts[k], whole[k]) for k in whole)
