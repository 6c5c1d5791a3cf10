"""Pipelined steps (engine/scheduler.py): the driver plans and sends step n + 1 before it applies step n's
result, and the rank feeds the token it sampled itself (Decode.token None). Every request must end with the
same tokens and finish reason as with unpipelined steps, whatever ends it (max_tokens, max_seq_len, a stop
token, a stop string, cancellation), while slots change hands and a long prompt is prefilled in chunks."""

import pytest
import torch

from conftest import hf_model
from refs import build, hf_logits_and_tokens
from shardlm.engine.requests import GenerationParams, Request
from shardlm.engine.scheduler import Scheduler
from shardlm.engine.text import load_tokenizer
from shardlm.parallel.context import ParallelContext
from shardlm.plan.plan import KVBudget
from shardlm.runtime.serve_step import SlotRunner
from shardlm.runtime.work import Step

SLOTS, MAX_LEN, CHUNK = 3, 64, 16
CANCEL_AFTER = 4


@pytest.fixture(scope="module")
def rank(bundled_dir):
    return build(bundled_dir, kv=KVBudget(SLOTS, MAX_LEN, CHUNK))


@pytest.fixture(scope="module")
def tokenizer(bundled_dir):
    return load_tokenizer(bundled_dir)


def _prompt(n: int, salt: int) -> list[int]:
    return [100 + (37 * i + 11 * salt) % 3000 for i in range(n)]


def _requests(stop_token: int | None, stop_text: str | None) -> list[Request]:
    g = GenerationParams
    params = [
        (10, g(max_tokens=8, temperature=0)),
        (40, g(max_tokens=6, temperature=0)),  # three chunks, beside running decodes
        (5, g(max_tokens=12, temperature=0.8, seed=7)),  # cancelled after CANCEL_AFTER tokens
        (20, g(max_tokens=MAX_LEN, temperature=0)),  # ends on max_seq_len
        (8, g(max_tokens=20, temperature=0, stop_token_ids=(stop_token,) if stop_token is not None else ())),
        (12, g(max_tokens=20, temperature=0, stop=(stop_text,) if stop_text else ())),
        (6, g(max_tokens=1, temperature=0.9, seed=3)),
    ]
    return [Request(_prompt(n, i), p) for i, (n, p) in enumerate(params)]


def _drive(rank, tokenizer, reqs: list[Request], pipelined: bool, decode_run: int = 1) -> dict:
    """Run `reqs` to the end on one in-process rank; the rows each step computed, the Decode rows fed from
    the rank's own samples, and the steps that ran their decode rows more than once."""
    sched = Scheduler(SLOTS, MAX_LEN, CHUNK, (0,), decode_run=decode_run)
    runner = SlotRunner(rank, ParallelContext())
    for r in reqs:
        sched.add(r)
    counts = {"rows": 0, "held": 0, "repeated": 0}
    under_way: tuple[Step, object] | None = None

    def apply(step, result):
        sched.apply(step, result, tokenizer)
        if len(reqs[2].output_ids) >= CANCEL_AFTER:
            reqs[2].cancel()

    for _ in range(500):
        step = sched.next_step()
        if step.empty:
            if under_way is None:
                break
            apply(*under_way)
            under_way = None
            continue
        counts["rows"] += len(step.decodes) * step.repeat
        counts["repeated"] += step.repeat > 1
        counts["held"] += sum(d.token is None for d in step.decodes)
        result = runner.run(step)  # the rank runs steps in order; the driver applies the one before later
        if under_way is not None:
            apply(*under_way)
        under_way = (step, result)
        if not pipelined:
            apply(*under_way)
            under_way = None
    assert sched.idle(), "the requests did not finish within 500 steps"
    return counts


def test_pipelined_steps_give_every_request_the_same_tokens_and_ending(rank, tokenizer):
    probe = _requests(None, None)
    _drive(rank, tokenizer, probe, pipelined=False)
    stop_token = probe[4].output_ids[5]  # end request 4 on its sixth token
    stop_text = tokenizer.decode(probe[5].output_ids[3:5]).strip()[:3]  # end request 5 inside its output
    assert stop_text, "the probe produced no text to stop on"

    plain, piped = _requests(stop_token, stop_text), _requests(stop_token, stop_text)
    n_plain = _drive(rank, tokenizer, plain, pipelined=False)
    n_piped = _drive(rank, tokenizer, piped, pipelined=True)
    for a, b in zip(plain, piped):
        assert b.output_ids == a.output_ids, f"{a.id}: pipelined tokens differ"
        assert b.finish_reason == a.finish_reason
        assert b.pending == 0
    assert [r.finish_reason for r in plain] == ["length", "length", "cancelled", "length", "stop", "stop", "length"]
    assert len(plain[2].output_ids) == CANCEL_AFTER
    assert len(plain[3].prompt_ids) + len(plain[3].output_ids) == MAX_LEN
    assert n_plain["held"] == 0
    assert n_piped["held"] > 0, "no decode row used the token its rank held"
    # a request that ends on a token the driver sees late may cost one row of the step under way, no more
    assert n_plain["rows"] <= n_piped["rows"] <= n_plain["rows"] + 3


@pytest.mark.parametrize("pipelined,decode_run", [(False, 8), (True, 8), (True, 3)])
def test_decode_runs_give_every_request_the_same_tokens_and_ending(rank, tokenizer, pipelined, decode_run):
    """Steps that decode several tokens a row (Scheduler.decode_run) end every request as single steps do; only
    a cancellation, seen at a step boundary, may land later (its tokens up to then are the same)."""
    probe = _requests(None, None)
    _drive(rank, tokenizer, probe, pipelined=False)
    stop_token = probe[4].output_ids[5]
    stop_text = tokenizer.decode(probe[5].output_ids[3:5]).strip()[:3]
    plain, runs = _requests(stop_token, stop_text), _requests(stop_token, stop_text)
    n_plain = _drive(rank, tokenizer, plain, pipelined=False)
    n_runs = _drive(rank, tokenizer, runs, pipelined=pipelined, decode_run=decode_run)
    for i, (a, b) in enumerate(zip(plain, runs)):
        assert b.finish_reason == a.finish_reason and b.pending == 0
        if i == 2:  # cancelled after CANCEL_AFTER tokens: a run under way may have given it more
            assert b.output_ids[:CANCEL_AFTER] == a.output_ids and len(b.output_ids) <= CANCEL_AFTER + 2 * decode_run
        else:
            assert b.output_ids == a.output_ids, f"{a.id}: tokens differ with decode runs of {decode_run}"
    assert len(runs[3].prompt_ids) + len(runs[3].output_ids) == MAX_LEN  # a run never passes max_seq_len
    assert n_runs["repeated"] > 0, "no step ran its decode rows more than once"
    # rows computed past an ending: at most two runs (the one under way and the next) for each of 7 requests
    assert n_plain["rows"] <= n_runs["rows"] <= n_plain["rows"] + 7 * 2 * decode_run


def test_a_decode_run_waits_for_prompts_and_stops_at_the_first_rows_limit(rank):
    """No run while a prompt waits or is prefilling; a run is as long as the row with the least room allows."""
    sched = Scheduler(2, MAX_LEN, CHUNK, (0,), decode_run=8)
    a = Request(_prompt(4, 1), GenerationParams(max_tokens=20, temperature=0))
    b = Request(_prompt(4, 2), GenerationParams(max_tokens=5, temperature=0))
    c = Request(_prompt(4, 3), GenerationParams(max_tokens=5, temperature=0))
    for r in (a, b, c):
        sched.add(r)
    first = sched.next_step()
    assert first.repeat == 1 and len(first.prefills) == 2  # c waits for a slot
    from shardlm.runtime.work import Sampled, StepResult

    sched.apply(first, StepResult(first.id, {0: Sampled(7), 1: Sampled(7)}), None)
    step = sched.next_step()
    assert step.repeat == 1, "a request waits for a slot: no run"
    c.cancel()
    sched.apply(step, StepResult(step.id, {0: Sampled(7), 1: Sampled(7)}), None)
    step = sched.next_step()  # b has made 2 of its 5 tokens: a run of 3
    assert step.repeat == 3 and [d.position for d in step.decodes] == [5, 5]
    assert a.pending == b.pending == 3


def test_a_request_cancelled_during_a_run_gets_one_more_token(rank, tokenizer):
    """A cancellation that lands while a run is under way costs the run's first token, as a single step would, not
    the whole run."""
    sched = Scheduler(SLOTS, MAX_LEN, CHUNK, (0,), decode_run=8)
    runner = SlotRunner(rank, ParallelContext())
    r = Request(_prompt(6, 9), GenerationParams(max_tokens=30, temperature=0))
    sched.add(r)
    step = sched.next_step()
    sched.apply(step, runner.run(step), tokenizer)
    step = sched.next_step()
    assert step.repeat == 8
    result = runner.run(step)
    r.cancel()  # while the run is under way
    sched.apply(step, result, tokenizer)
    assert sched.next_step().empty and r.finish_reason == "cancelled" and len(r.output_ids) == 2 and r.pending == 0


def test_the_driver_waits_longer_for_a_step_of_several_runs(bundled_dir):
    """`timeout_s` bounds a decode run, not a message: a step of 8 runs may take 8 times as long."""
    from refs import plan_for
    from shardlm.engine.service import Engine
    from shardlm.runtime.work import StepResult

    plan, source = plan_for(bundled_dir)
    engine = Engine(plan, source, timeout_s=5.0, decode_run=8)  # constructing it starts no rank
    waits = []

    class Group:
        timeout_s = 5.0

        def receive(self, timeout):
            waits.append(timeout)
            return "step", 0, StepResult(1, {})

    engine.group = Group()
    engine._receive_step(8)
    engine._receive_step()
    assert waits == [40.0, 5.0]
    with pytest.raises(ValueError, match="at least 1"):
        Engine(plan, source, decode_run=0)


def test_pipelined_greedy_tokens_equal_transformers(rank, tokenizer, bundled_dir):
    """The two modes could agree and both be wrong: the greedy requests also equal transformers' tokens."""
    reqs = _requests(None, None)
    _drive(rank, tokenizer, reqs, pipelined=True)
    model = hf_model(bundled_dir)
    for r in (reqs[0], reqs[1], reqs[3]):
        with torch.no_grad():
            _, want = hf_logits_and_tokens(model, [r.prompt_ids], len(r.output_ids))
        assert r.output_ids == want[0], f"{r.id}: pipelined greedy tokens differ from transformers'"


def test_engines_pipeline_steps_by_default_only_for_gpu_ranks(bundled_dir):
    """An Engine left to choose (`serve`'s) pipelines its steps for GPU ranks, whose compute leaves the host's cores
    to the driver, and not for CPU ranks, where a server's per-token work competes with them; an explicit choice
    stands, and pipeline stages never pipeline steps. Constructing an Engine starts no rank."""
    import dataclasses

    from refs import plan_for
    from shardlm.engine.service import Engine

    plan, source = plan_for(bundled_dir)
    gpu = dataclasses.replace(plan, device="cuda")
    assert not Engine(plan, source).pipelined and Engine(gpu, source).pipelined
    assert Engine(plan, source, pipelined=True).pipelined and not Engine(gpu, source, pipelined=False).pipelined
    staged, _ = plan_for(bundled_dir, pp=2)
    assert not Engine(dataclasses.replace(staged, device="cuda"), source).pipelined
