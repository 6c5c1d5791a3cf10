"""Greedy decode runs in one compiled call (runtime/greedy_run.py): every token and every cache value equal to the
runs taken one Python step at a time, for each kind of model the call takes (float32, bfloat16, int8 and int4 weights
with their int8 embedding; biases, tied heads, a sliding window, scaled rotary), rows at different positions; rows the
call does not take (sampled, with logprobs) run as before."""

import pytest
import torch

from refs import build
from shardlm.parallel.context import ParallelContext
from shardlm.plan.plan import KVBudget
from shardlm.runtime.greedy_run import rope_table
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.serve_step import SlotRunner
from shardlm.runtime.work import Decode, Prefill, SlotStart, Step
from shardlm.models.llama import rope_cos_sin

SLOTS, MAX_LEN, CHUNK = 3, 64, 16
FORMATS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
           "int8": dict(quantization="int8", quantize_embedding=True),
           "int4": dict(quantization="int4", quantize_embedding=True)}


def _run(rank, compiled: bool, params, repeat: int = 6, steps: int = 3):
    """Prompts of 5, 9 and 3 tokens in three slots, then `steps` steps of `repeat` decode runs; every run's tokens
    and the caches after."""
    runner = SlotRunner(rank, ParallelContext())
    if not compiled:
        runner.greedy = None
    prompts = [tuple(range(10, 15)), tuple(range(40, 49)), (7, 8, 9)]
    starts = tuple(SlotStart(s, s) for s in range(3))
    runner.run(Step(0, starts, tuple(Prefill(s, p, 0, True, params[s]) for s, p in enumerate(prompts)), ()))
    pos = [len(p) for p in prompts]
    tokens = []
    for i in range(steps):
        res = runner.run(Step(1 + i, (), (), tuple(Decode(s, None, pos[s], params[s]) for s in range(3)), repeat))
        tokens.append([[res.slots[s].token for s in range(3)]] + [[run[s].token for s in range(3)] for run in res.later])
        pos = [q + repeat for q in pos]
    caches = [(runner.cache.k[i].clone(), runner.cache.v[i].clone()) for i in rank.layer_ids]
    return tokens, caches, runner


def _assert_same(a, b):
    (ta, ca, _), (tb, cb, _) = a, b
    assert ta == tb
    for (ka, va), (kb, vb) in zip(ca, cb):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("name", ["gqa12x4", "qwen2", "llama3rope", "biased_mha", "mistral_window"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compiled_runs_equal_python_steps(name, fmt, random_dirs):
    rank = build(random_dirs[name], kv=KVBudget(SLOTS, MAX_LEN, CHUNK), **FORMATS[fmt])
    greedy = [SamplingParams()] * 3
    compiled = _run(rank, True, greedy)
    assert compiled[2].greedy is not None, "the compiled run should take this model"
    _assert_same(compiled, _run(rank, False, greedy))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compiled_runs_equal_python_steps_on_the_bundled_model(fmt, bundled_dir):
    """The bundled model's head_dim (64) takes the rotary rows from the table."""
    rank = build(bundled_dir, kv=KVBudget(SLOTS, MAX_LEN, CHUNK), **FORMATS[fmt])
    greedy = [SamplingParams()] * 3
    compiled = _run(rank, True, greedy, repeat=8)
    assert compiled[2].greedy.gm.cos_table is not None
    _assert_same(compiled, _run(rank, False, greedy, repeat=8))


def test_a_sampled_row_keeps_the_python_steps(random_dirs):
    """A step with a sampled row is not taken (every row of the step runs its tokens one by one, as before)."""
    rank = build(random_dirs["gqa12x4"], kv=KVBudget(SLOTS, MAX_LEN, CHUNK))
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams()]
    runner = SlotRunner(rank, ParallelContext())
    assert not runner.greedy.applies([Decode(s, 1, 4, params[s]) for s in range(3)], 4)
    assert not runner.greedy.applies([Decode(0, 1, 4, SamplingParams(), 2)], 4)  # logprobs asked
    assert not runner.greedy.applies([Decode(0, 1, MAX_LEN - 2, SamplingParams())], 4)  # past the cache
    _assert_same(_run(rank, True, params), _run(rank, False, params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_table_rows_are_the_step_values(dtype):
    """Built in blocks below torch's parallel grain, the table's rows equal rope_cos_sin's for steps of 1 and 3 rows."""
    hd, max_len = 64, 1500
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    cos, sin = rope_table(inv_freq, max_len, hd, dtype)
    for rows in ([0], [1, 700, 1499], [5, 5, 900]):
        c, s = rope_cos_sin(inv_freq, torch.tensor(rows)[:, None], dtype)  # (b, 1, 1, hd)
        assert torch.equal(c.reshape(len(rows), hd), cos[rows]) and torch.equal(s.reshape(len(rows), hd), sin[rows])
