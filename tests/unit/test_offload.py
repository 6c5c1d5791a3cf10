"""Layers streamed from disk under a budget: same logits as in memory, budgets, scratch files, bad folders."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from shardlm.models.args import read_config
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.models.registry import args_for_config
from shardlm.parallel.context import ParallelContext
from shardlm.quant import model_bytes
from shardlm.runtime.load import build_rank_model, shard_coord
from shardlm.runtime.offload import OffloadError, layer_tensors
from shardlm.runtime.step import attention_mask, positions_for

CFG = {**PRESETS["debug"], "num_hidden_layers": 6}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_checkpoint(CFG, tmp_path_factory.mktemp("off") / "m", seed=11)


def _build(folder, **kw):
    family, args = args_for_config(read_config(folder))
    return build_rank_model(folder, family, args, shard_coord(args, 0, 1), ParallelContext(), kernels="torch", **kw)


def _logits(model, steps: int = 3) -> list[torch.Tensor]:
    """Logits of a prompt and of `steps` more forward passes (the layers are streamed each time)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for s in range(steps):
        ids = torch.randint(0, 1001, (2, 5 + s), generator=g)
        valid = torch.ones_like(ids, dtype=torch.bool)
        out.append(model(ids, positions_for(valid), attention_mask(valid, 0, ids.shape[1], None)))
    return out


def _scratch(path) -> list[str]:
    return [p for p in os.listdir(path) if p.startswith(".shardlm-offload")] if os.path.isdir(path) else []


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("prefetch,io", [(True, "mmap"), (False, "mmap"), (True, "read"), (False, "read")])
def test_streamed_layers_give_the_same_logits_as_resident_ones(folder, tmp_path, quantization, prefetch, io):
    ref = _build(folder, quantization=quantization)
    whole = model_bytes(ref)
    layer = sum(t.numel() * t.element_size() for _, _, t in layer_tensors(ref.model.layers["0"]))
    budget = whole - layer // 2  # embedding/head + 2 read buffers + 3 resident layers, 3 streamed
    model = _build(folder, quantization=quantization, memory_budget=budget, offload_dir=tmp_path, prefetch=prefetch,
                   offload_io=io)
    plan, streamer = model.stream_plan, model.streamer
    assert 0 < len(plan.streamed) < CFG["num_hidden_layers"], plan
    assert model_bytes(model) <= budget
    for a, b in zip(_logits(ref), _logits(model)):
        assert torch.equal(a, b)
    assert _scratch(tmp_path)
    streamer.close()  # waits for the prefetch of the next pass's first layer
    assert not _scratch(tmp_path), "scratch file left behind"
    first = streamer.extents[streamer.order[0]].nbytes
    assert streamer.stats.reads == 3 * len(plan.streamed) + (1 if prefetch else 0)
    assert streamer.stats.bytes_read == 3 * streamer.bytes_per_pass + (first if prefetch else 0)
    assert streamer.bytes_per_pass <= sum(plan.layer_bytes[i] for i in plan.streamed)  # the plan is conservative


def test_a_budget_that_holds_everything_streams_nothing_and_too_small_a_one_names_the_minimum(folder, tmp_path):
    model = _build(folder, memory_budget=2**30, offload_dir=tmp_path)
    assert "streamer" not in model.__dict__ and not _scratch(tmp_path)
    with pytest.raises(OffloadError, match=r"needs at least.*use --memory-budget \d+MB or more"):
        _build(folder, memory_budget=2**16, offload_dir=tmp_path)


def test_a_full_offload_folder_fails_clearly_and_leaves_no_partial_file(folder, tmp_path, monkeypatch):
    real = os.pwrite
    calls = []

    def full(fd, data, offset):
        calls.append(1)
        if len(calls) > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    budget = model_bytes(_build(folder)) * 2 // 3
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OffloadError, match="filled up after .* MiB.*partial file was removed"):
        _build(folder, memory_budget=budget, offload_dir=tmp_path)
    assert not _scratch(tmp_path)


def test_an_unwritable_offload_folder_is_named(folder, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    budget = model_bytes(_build(folder)) * 2 // 3
    with pytest.raises(OffloadError, match="--offload-dir .*file cannot be used"):
        _build(folder, memory_budget=budget, offload_dir=blocker)


@pytest.mark.parametrize("tied", [False, True])
def test_a_budget_below_the_embedding_uses_it_and_the_head_in_place_from_the_file(tmp_path_factory, tied):
    cfg = {**CFG, "tie_word_embeddings": tied}
    folder = write_random_checkpoint(cfg, tmp_path_factory.mktemp("vocab") / "m", seed=12)
    ref = _build(folder)
    layer = sum(t.numel() * t.element_size() for _, _, t in layer_tensors(ref.model.layers["0"]))
    vocab = ref.model.embed_tokens.weight.nbytes
    # below embedding/head + two buffers, above norms + two buffers + an eighth of the head
    budget = 2 * layer + vocab // 2
    model = _build(folder, memory_budget=budget, offload_dir=tmp_path_factory.mktemp("o"))
    plan = model.stream_plan
    assert "model.embed_tokens.weight" in plan.vocab and ("lm_head.weight" in plan.vocab) == (not tied)
    assert model_bytes(model) <= budget
    for a, b in zip(_logits(ref), _logits(model)):
        assert torch.equal(a, b)
    assert model.streamer.bytes_per_pass >= vocab
    model.streamer.close()


def test_scratch_files_of_dead_ranks_are_swept_by_the_next_run(folder, tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".shardlm-offload-rank0-{dead.pid}.bin"
    stale.write_bytes(b"left by a killed rank")
    alive = tmp_path / f".shardlm-offload-rank1-{os.getpid()}.bin"
    alive.write_bytes(b"in use")
    model = _build(folder, memory_budget=model_bytes(_build(folder)) * 2 // 3, offload_dir=tmp_path)
    assert not stale.exists() and alive.exists()
    model.streamer.close()
