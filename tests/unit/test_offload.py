"""Layers streamed from disk under a budget: same logits as in memory, budgets, scratch files, bad folders."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from refs import build, plan_for
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.plan.plan import PlanError
from shardlm.runtime.offload import OffloadError, layer_tensors
from shardlm.runtime.step import attention_mask, positions_for
from shardlm.settings import Settings

CFG = {**PRESETS["debug"], "num_hidden_layers": 6}
TORCH = Settings(kernels="torch")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_checkpoint(CFG, tmp_path_factory.mktemp("off") / "m", seed=11)


def _build(folder, **kw):
    return build(folder, settings=TORCH, **kw)


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


def _layer_bytes(model) -> int:
    """Bytes of one decoder layer's linear weights (what streams)."""
    return sum(p.numel() * p.element_size() for n, p in model.module.model.layers["0"].named_parameters()
               if p.dim() == 2) or sum(t.numel() * t.element_size() for _, _, t in layer_tensors(model.module.model.layers["0"]))


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("prefetch,io", [(True, "mmap"), (False, "mmap"), (True, "read"), (False, "read")])
def test_streamed_layers_give_the_same_logits_as_resident_ones(folder, tmp_path, quantization, prefetch, io):
    ref = _build(folder, quantization=quantization)
    whole = ref.resident_bytes()
    budget = whole - _layer_bytes(ref) // 2  # embedding/head + 2 read buffers + 3 resident layers, 3 streamed
    flags = dict(quantization=quantization, memory_budget=budget, offload_dir=str(tmp_path), prefetch=prefetch)
    plan, _ = plan_for(folder, **flags)
    model = _build(folder, offload_io=io, **flags)
    streamer = model.streamer
    assert 0 < len(model.streamed) < CFG["num_hidden_layers"] and len(model.streamed) == plan.offload.layers[0]
    assert model.resident_bytes() <= budget
    assert streamer.bytes_per_pass == plan.predictions.memory[0].offloaded  # one memory model: the plan's bytes
    for a, b in zip(_logits(ref), _logits(model)):
        assert torch.equal(a, b)
    assert _scratch(tmp_path)
    model.close()  # waits for the prefetch of the next pass's first layer
    assert not _scratch(tmp_path), "scratch file left behind"
    first = streamer.extents[streamer.order[0]].nbytes
    assert streamer.stats.reads == 3 * len(model.streamed) + (1 if prefetch else 0)
    assert streamer.stats.bytes_read == 3 * streamer.bytes_per_pass + (first if prefetch else 0)


def test_a_budget_that_holds_everything_streams_nothing_and_too_small_a_one_names_the_minimum(folder, tmp_path):
    model = _build(folder, memory_budget=2**30, offload_dir=str(tmp_path))
    assert model.streamer is None and not model.streamed and not _scratch(tmp_path)
    with pytest.raises(PlanError, match=r"needs at least.*use --memory-budget \d+MB or more"):
        _build(folder, memory_budget=2**16, offload_dir=str(tmp_path))


def test_a_full_offload_folder_fails_clearly_and_leaves_no_partial_file(folder, tmp_path, monkeypatch):
    real = os.pwrite
    calls = []

    def full(fd, data, offset):
        calls.append(1)
        if len(calls) > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    budget = _build(folder).resident_bytes() * 2 // 3
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OffloadError, match="filled up after .* MiB.*partial file was removed"):
        _build(folder, memory_budget=budget, offload_dir=str(tmp_path))
    assert not _scratch(tmp_path)


def test_an_unwritable_offload_folder_is_named(folder, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    budget = _build(folder).resident_bytes() * 2 // 3
    with pytest.raises(OffloadError, match="--offload-dir .*file cannot be used"):
        _build(folder, memory_budget=budget, offload_dir=str(blocker))


@pytest.mark.parametrize("tied", [False, True])
def test_a_budget_below_the_embedding_uses_it_and_the_head_in_place_from_the_file(tmp_path_factory, tied):
    cfg = {**CFG, "tie_word_embeddings": tied}
    folder = write_random_checkpoint(cfg, tmp_path_factory.mktemp("vocab") / "m", seed=12)
    ref = _build(folder)
    layer = _layer_bytes(ref)
    vocab = ref.module.model.embed_tokens.weight.nbytes
    # below embedding/head + two buffers, above norms + two buffers + an eighth of the head
    budget = 2 * layer + vocab // 2
    model = _build(folder, memory_budget=budget, offload_dir=str(tmp_path_factory.mktemp("o")))
    assert model.spec.offload.vocab and len(model.mapped) == (1 if tied else 2)  # a tied head is the embedding
    assert model.resident_bytes() <= budget
    # the head's product runs over blocks of rows mapped in turn: each logit is the same dot product, but
    # F.linear (prefill-sized inputs) may order its sums differently for a block than for the whole weight
    for a, b in zip(_logits(ref), _logits(model)):
        assert torch.allclose(a, b, rtol=0, atol=1e-6 * a.abs().max()) and torch.equal(a.argmax(-1), b.argmax(-1))
    assert model.streamer.bytes_per_pass >= vocab
    model.close()


def test_scratch_files_of_dead_ranks_are_swept_by_the_next_run(folder, tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".shardlm-offload-rank0-{dead.pid}.bin"
    stale.write_bytes(b"left by a killed rank")
    alive = tmp_path / f".shardlm-offload-rank1-{os.getpid()}.bin"
    alive.write_bytes(b"in use")
    model = _build(folder, memory_budget=_build(folder).resident_bytes() * 2 // 3, offload_dir=str(tmp_path))
    assert not stale.exists() and alive.exists()
    model.close()
