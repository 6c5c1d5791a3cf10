"""The CUDA-graph decoder's bookkeeping, run on the CPU with the replay stood in by a plain call of
the captured step: static buffers, the cache it owns, reuse across calls and length buckets."""

import pytest
import torch

from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.models.registry import args_for_config
from shardlm.parallel.context import ParallelContext
from shardlm.runtime import cuda_graph
from shardlm.runtime.load import build_rank_model, shard_coord
from shardlm.runtime.messages import SamplingParams
from shardlm.runtime.step import Batch, generate


class _Replay:
    """Stands in for torch.cuda.CUDAGraph: replay() recomputes the step on the same buffers."""

    def __init__(self, decoder):
        self.decoder = decoder

    def replay(self):
        self.decoder.logits.copy_(self.decoder._forward())


@pytest.fixture
def on_cpu(monkeypatch):
    def capture(self):
        self.logits = self._forward()
        self.graph = _Replay(self)

    monkeypatch.setattr(cuda_graph, "eligible", lambda model, device: model.__dict__.get("cuda_graphs", True))
    monkeypatch.setattr(cuda_graph.GraphDecoder, "_capture", capture)


def test_static_decoder_gives_the_eager_tokens_and_reuses_its_cache(tmp_path, on_cpu):
    config = {**PRESETS["debug"], "sliding_window": 7, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    folder = write_random_checkpoint(config, tmp_path / "m", seed=4)
    family, args = args_for_config(config)
    model = build_rank_model(folder, family, args, shard_coord(args, 0, 1), ParallelContext(), kernels="torch")
    g = torch.Generator().manual_seed(1)

    def prompts(lengths):
        return Batch.from_lists([torch.randint(3, 1001, (n,), generator=g).tolist() for n in lengths])

    cases = [prompts([13, 5, 9]), prompts([20, 3, 11]), prompts([8, 8])]
    model.cuda_graphs = False
    eager = [generate(model, b, 15, SamplingParams(), (), args.n_kv_heads) for b in cases]
    sampled_eager = generate(model, cases[0], 6, SamplingParams(temperature=0.9, seed=2), (), args.n_kv_heads)
    model.cuda_graphs = True
    for batch, want in zip(cases, eager):
        assert generate(model, batch, 15, SamplingParams(), (), args.n_kv_heads) == want
    # batches of 3 share one decoder (prompt + new tokens round up to one 256-slot bucket); 2 rows: another
    kept = model._graph_decoders
    assert len(kept) == 2 and all(d.cache.max_len == cuda_graph.BUCKET for d in kept.values())
    assert generate(model, cases[0], 6, SamplingParams(temperature=0.9, seed=2), (), args.n_kv_heads) == sampled_eager
    assert generate(model, cases[0], 1, SamplingParams(), (), args.n_kv_heads) == [t[:1] for t in eager[0]]
    assert len(kept) == 2
