"""Each rank reads only its own slices: its memory grows by what it owns, not by the whole model."""

import psutil
import pytest

from refs import build
from shardlm.models.random import write_random_checkpoint
from shardlm.models.registry import LLAMA_PRESETS
from shardlm.parallel.context import ParallelContext
from shardlm.parallel.launch import run_on_ranks
from shardlm.runtime.worker import peak_rss_bytes

WORKSPACE = 200 * 2**20
"""Fixed per-rank load overhead allowed: the 32 MB column-read chunk, packing scratch, the allocator."""


def _load(rank, world, folder):
    before = psutil.Process().memory_info().rss
    model = build(folder, rank, ParallelContext(rank, world), tp=world)
    owned = model.resident_bytes()
    return peak_rss_bytes() - before, owned


@pytest.fixture(scope="module")
def model_600mb(tmp_path_factory):
    cfg = {**LLAMA_PRESETS["debug"], "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}
    return write_random_checkpoint(cfg, tmp_path_factory.mktemp("m600") / "model")


def test_rank_memory_grows_by_its_own_slices_only(model_600mb):
    full = (model_600mb / "model.safetensors").stat().st_size
    results = run_on_ranks(_load, 4, str(model_600mb), timeout_s=240)
    for rank, (growth, owned) in enumerate(results):
        assert owned < 0.3 * full  # a quarter of the weights, plus replicated norms
        assert growth <= owned + WORKSPACE, (
            f"rank {rank}: peak RSS grew {growth / 2**20:.0f} MiB for {owned / 2**20:.0f} MiB of its own weights "
            f"(model {full / 2**20:.0f} MiB)")
