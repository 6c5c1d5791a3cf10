"""The CUDA-graph decoder's bookkeeping, run on the CPU with the replay stood in by a plain call of
the captured step: static buffers, the cache it owns, reuse across calls and length buckets."""

import pytest
import torch

from refs import build
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.runtime import cuda_graph
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.step import Batch, generate
from shardlm.settings import Settings


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

    monkeypatch.setattr(cuda_graph.GraphDecoder, "_capture", capture)


def test_static_decoder_gives_the_eager_tokens_and_reuses_its_cache(tmp_path, on_cpu):
    config = {**PRESETS["debug"], "sliding_window": 7, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    folder = write_random_checkpoint(config, tmp_path / "m", seed=4)
    model = build(folder, settings=Settings(kernels="torch"))
    args = model.args
    graphs = cuda_graph.GraphDecoders(model.module)  # what a one-GPU rank gets; replays stood in by calls
    g = torch.Generator().manual_seed(1)

    def prompts(lengths):
        return Batch.from_lists([torch.randint(3, 1001, (n,), generator=g).tolist() for n in lengths])

    cases = [prompts([13, 5, 9]), prompts([20, 3, 11]), prompts([8, 8])]
    assert model.graphs is None  # a CPU rank: eager decode
    eager = [generate(model, b, 15, SamplingParams(), ()) for b in cases]
    sampled_eager = generate(model, cases[0], 6, SamplingParams(temperature=0.9, seed=2), ())
    model.graphs = graphs
    for batch, want in zip(cases, eager):
        assert generate(model, batch, 15, SamplingParams(), ()) == want
    # batches of 3 share one decoder (prompt + new tokens round up to one 256-slot bucket); 2 rows: another
    kept = graphs.kept
    assert len(kept) == 2 and all(d.cache.max_len == cuda_graph.BUCKET for d in kept.values())
    assert generate(model, cases[0], 6, SamplingParams(temperature=0.9, seed=2), ()) == sampled_eager
    assert generate(model, cases[0], 1, SamplingParams(), ()) == [t[:1] for t in eager[0]]
    assert len(kept) == 2
