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
    def capture(self):  # a real capture records the step without running it: leave the inputs as they were
        state = [t.clone() for t in (self.tokens, self.positions, self.mask, self.slot)]
        self.logits = self._forward()
        for t, saved in zip((self.tokens, self.positions, self.mask, self.slot), state):
            t.copy_(saved)
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


@pytest.mark.parametrize("compile", [False, True], ids=["plain", "compiled"])
def test_decoder_that_advances_its_own_inputs_gives_the_eager_tokens(tmp_path, on_cpu, compile):
    # no sliding window: after a call's first step the replay moves mask, positions and slot on itself
    folder = write_random_checkpoint(PRESETS["debug"], tmp_path / "m", seed=5)
    model = build(folder, settings=Settings(kernels="torch"))
    g = torch.Generator().manual_seed(2)
    batches = [Batch.from_lists([torch.randint(3, 1001, (n,), generator=g).tolist() for n in lengths])
               for lengths in ([9, 4, 14], [3, 12, 7])]
    eager = [generate(model, b, 12, SamplingParams(), ()) for b in batches]
    sampled = generate(model, batches[1], 8, SamplingParams(temperature=0.8, seed=3), ())
    eos = (eager[0][0][4], eager[0][1][2], eager[0][2][6])  # every row stops early: greedy steps ran ahead
    stopped = generate(model, batches[0], 12, SamplingParams(), eos)
    assert max(map(len, stopped)) < 12
    model.graphs = graphs = cuda_graph.GraphDecoders(model.module, compile=compile)
    for batch, want in zip(batches, eager):  # the second call reuses the first one's decoder and cache
        assert generate(model, batch, 12, SamplingParams(), ()) == want
    (decoder,) = graphs.kept.values()
    assert decoder.advance and int(decoder.slot) == decoder.cache.offset  # the device slot kept pace
    assert generate(model, batches[0], 12, SamplingParams(), eos) == stopped
    assert generate(model, batches[1], 8, SamplingParams(temperature=0.8, seed=3), ()) == sampled
