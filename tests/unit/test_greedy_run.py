"""Greedy decode runs in one compiled call (runtime/greedy_run.py): every token and every cache value equal to the
runs taken one Python step at a time, for each kind of model the call takes (float32, bfloat16, int8 and int4 weights
with their int8 embedding; biases, tied heads, a sliding window, scaled rotary), rows at different positions; rows the
call does not take (sampled, with logprobs) take one compiled step at a time, with the same bits."""

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
           "int4": dict(quantization="int4", quantize_embedding=True),
           "int4, float embedding": dict(quantization="int4")}


def _run(rank, compiled: bool, params, repeat: int = 6, steps: int = 3, logprobs=(None, None, None)):
    """Prompts of 5, 9 and 3 tokens in three slots, then `steps` steps of `repeat` decode runs; every run's tokens
    (with their logprobs where `logprobs` asks) and the caches after. The runner counts its compiled calls
    (`runner.calls`: runs of tokens; `runner.logit_calls`: steps' logits)."""
    runner = SlotRunner(rank, ParallelContext())
    runner.calls = runner.logit_calls = 0
    if not compiled:
        runner.greedy = None
    elif runner.greedy is not None:
        compiled_tokens, compiled_logits = runner.greedy.tokens, runner.greedy.logits

        def counted(*args):
            out = compiled_tokens(*args)
            runner.calls += out is not None
            return out

        def counted_logits(*args):
            out = compiled_logits(*args)
            runner.logit_calls += out is not None
            return out
        runner.greedy.tokens, runner.greedy.logits = counted, counted_logits
    prompts = [tuple(range(10, 15)), tuple(range(40, 49)), (7, 8, 9)]
    starts = tuple(SlotStart(s, s) for s in range(3))
    runner.run(Step(0, starts, tuple(Prefill(s, p, 0, True, params[s]) for s, p in enumerate(prompts)), ()))
    pos = [len(p) for p in prompts]
    tokens = []
    for i in range(steps):
        res = runner.run(Step(1 + i, (), (), tuple(Decode(s, None, pos[s], params[s], logprobs[s]) for s in range(3)),
                              repeat))
        tokens.append([[(res.slots[s].token, res.slots[s].logprob) for s in range(3)]]
                      + [[(run[s].token, run[s].logprob) for s in range(3)] for run in res.later])
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
    assert compiled[2].calls == 3, "the compiled run should take every step of this model"
    _assert_same(compiled, _run(rank, False, greedy))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compiled_runs_equal_python_steps_on_the_bundled_model(fmt, bundled_dir):
    """The bundled model's head_dim (64) takes the rotary rows from the table."""
    rank = build(bundled_dir, kv=KVBudget(SLOTS, MAX_LEN, CHUNK), **FORMATS[fmt])
    greedy = [SamplingParams()] * 3
    compiled = _run(rank, True, greedy, repeat=8)
    assert compiled[2].calls == 3 and compiled[2].greedy.gm.cos_table is not None
    if fmt == "int8":  # the tied head and embedding in the paired order (csrc/qpairs.h), read as natural codes
        assert compiled[2].greedy.gm.head_paired and compiled[2].greedy.gm.embed_paired
    _assert_same(compiled, _run(rank, False, greedy, repeat=8))


@pytest.mark.parametrize("name", ["qwen2", "mistral_window"])
def test_single_steps_are_compiled_alike(name, random_dirs):
    """Steps of one run (a server's default) of greedy decode rows only: one compiled call a step, the same tokens
    and cache as the Python steps; a step with a prompt keeps the Python step for its first run."""
    rank = build(random_dirs[name], kv=KVBudget(SLOTS, MAX_LEN, CHUNK), quantization="int8", quantize_embedding=True)
    greedy = [SamplingParams()] * 3
    compiled = _run(rank, True, greedy, repeat=1, steps=10)
    assert compiled[2].calls == 10
    _assert_same(compiled, _run(rank, False, greedy, repeat=1, steps=10))


def test_the_clock_counts_each_run_once_and_the_step_time(random_dirs):
    """A compiled step of 6 runs adds 6 steps to the rank's clock, and their seconds are the step's."""
    rank = build(random_dirs["gqa12x4"], kv=KVBudget(SLOTS, MAX_LEN, CHUNK))
    runner = SlotRunner(rank, ParallelContext())
    greedy = SamplingParams()
    runner.run(Step(0, (SlotStart(0, 0),), (Prefill(0, (5, 6, 7), 0, True, greedy),), ()))
    count, seconds = runner.clock.count, runner.clock.sum
    res = runner.run(Step(1, (), (), (Decode(0, None, 3, greedy),), 6))
    assert len(res.later) == 5 and runner.clock.count == count + 6
    assert runner.clock.sum - seconds == pytest.approx(res.seconds, rel=1e-9, abs=1e-9)


def test_a_run_may_end_on_the_caches_last_position(random_dirs):
    """Runs up to position max_len - 1 are taken; one more is left to the Python steps (which name the limit)."""
    rank = build(random_dirs["gqa12x4"], kv=KVBudget(SLOTS, MAX_LEN, CHUNK))
    runner = SlotRunner(rank, ParallelContext())
    assert runner.greedy.applies([Decode(0, 1, MAX_LEN - 5, SamplingParams())], 1, 4)
    assert not runner.greedy.applies([Decode(0, 1, MAX_LEN - 5, SamplingParams())], 1, 5)
    assert runner.greedy.applies([Decode(0, 1, MAX_LEN - 5, SamplingParams())], 0, 5)


def test_a_sampled_row_keeps_the_python_steps(random_dirs):
    """A step with a sampled row is not taken (every row of the step runs its tokens one by one, as before)."""
    rank = build(random_dirs["gqa12x4"], kv=KVBudget(SLOTS, MAX_LEN, CHUNK))
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams()]
    runner = SlotRunner(rank, ParallelContext())
    assert not runner.greedy.applies([Decode(s, 1, 4, params[s]) for s in range(3)], 1, 4)
    assert not runner.greedy.applies([Decode(0, 1, 4, SamplingParams(), 2)], 1, 4)  # logprobs asked
    assert not runner.greedy.applies([Decode(0, 1, MAX_LEN - 2, SamplingParams())], 1, 4)  # past the cache
    _assert_same(_run(rank, True, params), _run(rank, False, params))


@pytest.mark.parametrize("name", ["gqa12x4", "mistral_window"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sampled_rows_take_one_compiled_step_at_a_time(name, fmt, random_dirs):
    """Steps with sampled rows or logprobs take each run's logits from one compiled step (GreedyRuns.logits): the same
    tokens, logprobs and caches as the Python steps."""
    rank = build(random_dirs[name], kv=KVBudget(SLOTS, MAX_LEN, CHUNK), **FORMATS[fmt])
    params = [SamplingParams(temperature=0.8, seed=3), SamplingParams(), SamplingParams(temperature=1.2, top_k=20)]
    compiled = _run(rank, True, params, repeat=3, logprobs=(2, None, 0))
    assert compiled[2].calls == 0 and compiled[2].logit_calls == 3 * 3
    assert all(run[0][1] is not None and run[1][1] is None for step in compiled[0] for run in step)
    _assert_same(compiled, _run(rank, False, params, repeat=3, logprobs=(2, None, 0)))
    greedy_logprobs = _run(rank, True, [SamplingParams()] * 3, repeat=2, logprobs=(None, 1, None))
    assert greedy_logprobs[2].calls == 0 and greedy_logprobs[2].logit_calls == 2 * 3
    _assert_same(greedy_logprobs, _run(rank, False, [SamplingParams()] * 3, repeat=2, logprobs=(None, 1, None)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_table_rows_are_the_step_values(dtype):
    """Built in blocks below torch's parallel grain, the table's rows equal rope_cos_sin's for steps of 1 and 3 rows."""
    hd, max_len = 64, 1500
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    cos, sin = rope_table(inv_freq, max_len, hd, dtype)
    for rows in ([0], [1, 700, 1499], [5, 5, 900]):
        c, s = rope_cos_sin(inv_freq, torch.tensor(rows)[:, None], dtype)  # (b, 1, 1, hd)
        assert torch.equal(c.reshape(len(rows), hd), cos[rows]) and torch.equal(s.reshape(len(rows), hd), sin[rows])


def test_python_threads_run_during_a_compiled_run(random_dirs):
    """The compiled call lets go of the GIL: the rank's heartbeat thread keeps stamping through a long run (a run
    holding it for longer than the driver's hang limit would get a healthy rank stopped)."""
    import threading
    import time

    rank = build(random_dirs["gqa12x4"], kv=KVBudget(SLOTS, 1024, CHUNK))
    runner = SlotRunner(rank, ParallelContext())
    greedy = SamplingParams()
    runner.run(Step(0, (SlotStart(0, 0),), (Prefill(0, (5, 6, 7), 0, True, greedy),), ()))
    stamps, done = [], threading.Event()

    def stamp():
        while not done.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=stamp)
    thread.start()
    try:
        t0 = time.perf_counter()
        runner.run(Step(1, (), (), (Decode(0, None, 3, greedy),), 1000))  # ~70 ms of tokens in one call
        took = time.perf_counter() - t0
    finally:
        done.set()
        thread.join(timeout=10)
    inside = [t for t in stamps if t0 <= t <= t0 + took]
    gaps = [b - a for a, b in zip(inside, inside[1:])]
    assert took > 0.01 and len(inside) > 3 and max(gaps) < took / 2, (took, len(inside), max(gaps, default=None))


def test_the_phase_clock_times_each_thread_and_phase_only_when_on(random_dirs):
    """The fused step's phase clock (csrc/team.h, bench/step_phases.py): on, a run of 6 steps counts 6 steps, every
    thread of the step's team gets work in each of a block's six phases, and a thread's work and waits fit inside the
    steps' parallel regions; off, nothing is counted; the tokens are the same either way."""
    rank = build(random_dirs["gqa12x4"], kv=KVBudget(SLOTS, MAX_LEN, CHUNK))
    if rank.ops is None or not hasattr(rank.ops, "step_phases"):
        pytest.skip("the compiled kernels are not available here")
    greedy, got = SamplingParams(), []
    for on in (True, False):
        runner = SlotRunner(rank, ParallelContext())
        runner.run(Step(0, (SlotStart(0, 0),), (Prefill(0, (5, 6, 7), 0, True, greedy),), ()))
        rank.ops.step_phases(on)
        try:
            res = runner.run(Step(1, (), (), (Decode(0, None, 3, greedy),), 6))
            times, region, steps = rank.ops.step_phase_times()
        finally:
            rank.ops.step_phases(False)
        got.append([res.slots[0].token] + [run[0].token for run in res.later])
        if not on:
            assert steps == 0 and region == 0 and not times.any()
            continue
        team = torch.get_num_threads()
        assert steps == 6 and region > 0
        assert (times[:team, :6, 0] > 0).all(), times[:team, :6]
        assert not times[team:].any() and not times[:, 6:].any()
        assert (times[:team, :6].sum(dim=(1, 2)) <= region * 1.01 + 1e-4).all()
    assert got[0] == got[1]
