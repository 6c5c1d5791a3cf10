"""The serving engine's captured decode step (runtime/slot_graphs.py), run on the CPU with each replay stood in by a
plain call of the captured step: rows are the first slots, idle slots ride along, every row attends over a length
bucket of its own slot under a mask made from the positions. A request's tokens must equal the eager step's,
whichever slots decode beside it and while other slots are being prefilled."""

import pytest
import torch

from refs import build
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from shardlm.parallel.context import ParallelContext
from shardlm.plan.plan import KVBudget
from shardlm.runtime import slot_graphs
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.serve_step import SlotRunner
from shardlm.runtime.work import Decode, Prefill, SlotStart, Step
from shardlm.settings import Settings

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.9, seed=5)


def _script(prompts: dict[int, list[int]]) -> list[tuple]:
    """(starts, prefills, decoding slots) per step: slots 0, 2, 4 start together; slot 1 starts at step 2 with its
    prompt in two chunks while the others decode; slot 2 stops after step 4; slot 5 starts at step 5."""
    p = prompts
    return [([0, 2, 4], [(0, p[0], 0), (2, p[2], 0), (4, p[4], 0)], []),
            ([], [], [0, 2, 4]),
            ([1], [(1, p[1][:5], 0)], [0, 2, 4]),
            ([], [(1, p[1][5:], 5)], [0, 2, 4]),
            ([], [], [0, 1, 2, 4]),
            ([5], [(5, p[5], 0)], [0, 1, 4]),
            *[([], [], [0, 1, 4, 5])] * 6]


def _run(runner: SlotRunner, prompts: dict[int, list[int]], params: dict[int, SamplingParams]) -> dict[int, list]:
    tokens: dict[int, list[int]] = {s: [] for s in prompts}
    position = {s: 0 for s in prompts}
    for i, (starts, prefills, decoding) in enumerate(_script(prompts)):
        step = Step(i, tuple(SlotStart(s, 11 + s) for s in starts),
                    tuple(Prefill(s, tuple(t), a, a + len(t) == len(prompts[s]), params[s]) for s, t, a in prefills),
                    tuple(Decode(s, tokens[s][-1], position[s], params[s]) for s in decoding))
        for s, t, a in prefills:
            position[s] = a + len(t)
        for s in decoding:
            position[s] += 1
        for slot, got in runner.run(step).slots.items():
            if got.token is not None:
                tokens[slot].append(got.token)
    return tokens


@pytest.mark.parametrize("window,max_len", [(None, 300), (6, 64)], ids=["bucketed", "sliding-window"])
def test_replayed_decode_steps_give_the_eager_tokens(tmp_path, on_cpu, window, max_len):
    config = dict(PRESETS["debug"])
    if window:
        config.update(sliding_window=window, model_type="mistral", architectures=["MistralForCausalLM"])
    folder = write_random_checkpoint(config, tmp_path / "m", seed=8)
    g = torch.Generator().manual_seed(3)
    prompts = {s: torch.randint(3, 1001, (n,), generator=g).tolist() for s, n in
               {0: 9, 1: 12, 2: 4, 4: 7, 5: 3}.items()}
    if max_len > 256:  # slot 4 runs past the first length bucket of 256 positions
        prompts[4] = torch.randint(3, 1001, (252,), generator=g).tolist()
    params = {s: (SAMPLED if s == 2 else GREEDY) for s in prompts}
    runs = {}
    for replayed in (False, True):
        rank = build(folder, kv=KVBudget(6, max_len, 512), settings=Settings(kernels="torch"))
        runner = SlotRunner(rank, ParallelContext())
        assert runner.graphs is None  # a CPU rank: eager
        if replayed:
            runner.graphs = slot_graphs.SlotGraphs(rank.module, runner.cache, runner.window)
        runs[replayed] = _run(runner, prompts, params)
        kept = runner.graphs.kept if replayed else {}
    assert runs[True] == runs[False]
    assert all(len(t) > 1 for t in runs[True].values())
    assert {r for r, _ in kept} == {6}  # slots up to 4 and 5 decode: the next power of two, at most all 6 slots
    if max_len > 256:
        assert {length for _, length in kept} == {256, 300}


def test_shapes_cover_the_slots_and_positions(tmp_path):
    folder = write_random_checkpoint(PRESETS["debug"], tmp_path / "m", seed=9)
    rank = build(folder, kv=KVBudget(12, 1000, 64), settings=Settings(kernels="torch"))
    runner = SlotRunner(rank, ParallelContext())
    graphs = slot_graphs.SlotGraphs(rank.module, runner.cache, runner.window)
    assert graphs.shape([0], [0]) == (1, 256)
    assert graphs.shape([2, 0], [255, 3]) == (4, 256)
    assert graphs.shape([4], [256]) == (8, 512)
    assert graphs.shape([11, 3], [998, 0]) == (12, 1000)  # at most all slots, at most the slot length
