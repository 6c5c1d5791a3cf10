"""Prompts share their common prefixes (engine/scheduler.py): a prompt whose next tokens another request's KV-cache
slot holds already copies their keys and values (Step.copies) instead of computing them, and every request's
tokens stay the ones it gets alone."""

import queue
import random

import pytest
import torch

from shardlm.engine.requests import GenerationParams, Request
from shardlm.engine.scheduler import MIN_SHARED, Scheduler, _common_prefix

CHUNK = 16


def _plan(prompts: list[list[int]], anchored: bool = False, echo: tuple[int, ...] = (), steps: int = 8):
    """Per step, the prompt chunks (request index, start, length) and copies (source index, target index, start,
    end) the scheduler plans (no decoding), and the requests."""
    s = Scheduler(4, 256, CHUNK, eos_ids=(), anchored=anchored)
    reqs = [Request(list(p), GenerationParams(max_tokens=0, logprobs=0 if i in echo else None, echo=i in echo))
            for i, p in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    out = []
    for _ in range(steps):
        step = s.next_step()
        index = {r.slot: i for i, r in enumerate(reqs)}
        out.append(([(index[p.slot], p.start, len(p.tokens)) for p in step.prefills],
                    [(index[c.src], index[c.dst], c.start, c.end) for c in step.copies]))
    return out, reqs


def test_copies_of_one_prompt_compute_it_once_and_their_own_last_token():
    """Four requests with one 40-token prompt (the n choices of a call): the first computes it; the others wait
    while it does, then copy what its slot holds and compute the rest, at least their last two tokens."""
    prompt = list(range(100, 140))
    steps, reqs = _plan([prompt] * 4)
    assert steps[0] == ([(0, 0, 16)], [])
    assert steps[1] == ([(0, 16, 16)], [])
    assert steps[2] == ([(0, 32, 8), (1, 32, 8)], [(0, 1, 0, 32)])
    assert steps[3] == ([(2, 38, 2), (3, 38, 2)], [(0, 2, 0, 38), (0, 3, 0, 38)])
    assert not any(p or c for p, c in steps[4:])
    assert [r.shared for r in reqs] == [0, 32, 38, 38] and all(r.done_prefill for r in reqs)


def test_anchored_copies_end_on_a_chunk_boundary():
    """With anchored chunks a copy ends on a multiple of the chunk, so each chunk a prompt computes is one it
    would compute alone."""
    steps, reqs = _plan([list(range(100, 140))] * 4, anchored=True)
    copies = [c for _, cs in steps for c in cs]
    assert copies == [(0, 1, 0, 32), (0, 2, 0, 32), (0, 3, 0, 32)]
    chunks = [p for ps, _ in steps for p in ps]
    assert all(start % CHUNK == 0 for _, start, _ in chunks)
    assert sorted(c for c in chunks if c[0]) == [(1, 32, 8), (2, 32, 8), (3, 32, 8)]


def test_a_shared_system_prompt_is_copied_and_the_rest_computed():
    """Two prompts that begin with the same 24 tokens: the second copies those from the first's slot."""
    system = list(range(500, 524))
    steps, reqs = _plan([system + list(range(10)), system + list(range(1000, 1020))])
    assert [c for _, cs in steps for c in cs] == [(0, 1, 0, 24)]
    assert [p for p in steps[2][0] if p[0] == 1] == [(1, 24, 14)]
    assert reqs[1].shared == 24


def test_no_copy_below_the_minimum_or_for_a_prompt_that_wants_its_logprobs():
    """A common prefix under MIN_SHARED tokens is computed; a request that asks for its prompt's logprobs (echo)
    computes all of its prompt, though another may copy from it."""
    short = list(range(MIN_SHARED - 1))
    steps, _ = _plan([short + [1] * 20, short + [2] * 20])
    assert not [c for _, cs in steps for c in cs]
    prompt = list(range(200, 240))
    steps, reqs = _plan([prompt, prompt, prompt], echo=(1,))
    assert [r.shared for r in reqs] == [0, 0, 38]
    assert sum(n for ps, _ in steps for i, _, n in ps if i == 1) == 40


def _prefill_all(s: Scheduler) -> list:
    """Plan steps until no prompt is left to prefill; the steps."""
    steps = []
    while s.prompt_work() and len(steps) < 50:
        steps.append(s.next_step())
    return steps


def test_a_slot_keeps_its_last_prompt_for_the_next_request_that_shares_it():
    """A finished request's slot keeps its prompt: the next request that begins with it takes that slot and
    prefills only what is new; a different prompt takes a slot that keeps nothing and computes all of it."""
    s = Scheduler(3, 256, CHUNK, eos_ids=())
    prompt = list(range(300, 340))
    first, other = Request(prompt, GenerationParams(max_tokens=0)), Request(list(range(40)), GenerationParams(0))
    s.add(other), s.add(first)
    _prefill_all(s)
    assert (other.slot, first.slot) == (0, 1)
    first.finish_reason = "length"
    s.release()
    turn = Request(prompt + [7, 8, 9], GenerationParams(max_tokens=0))
    again = Request(prompt, GenerationParams(max_tokens=0))
    fresh = Request(list(range(900, 930)), GenerationParams(max_tokens=0))
    for r in (fresh, turn):
        s.add(r)
    steps = _prefill_all(s)
    assert (fresh.slot, turn.slot) == (2, 1) and (fresh.shared, turn.shared) == (0, 40)
    planned = [(p.start, len(p.tokens)) for st in steps for p in st.prefills if p.slot == 1]
    assert planned[0][0] == 40 and sum(n for _, n in planned) == 3 and not any(st.copies for st in steps)
    s.add(again)  # no free slot: waits; then copies from a running request's or a kept slot's prompt
    for r in (fresh, turn):
        r.finish_reason = "length"
    s.release()
    steps = _prefill_all(s)
    assert again.shared == 38 and [(p.start, len(p.tokens)) for st in steps for p in st.prefills] == [(38, 2)]
    s.fail_all("a rank died")
    assert not s.held  # what lost ranks held is not offered again


@pytest.mark.parametrize("a, b, limit, want", [([1, 2, 3], [1, 2, 4], 9, 2), ([1, 2, 3], [1, 2, 3], 9, 3),
                                              ([1, 2, 3], [1, 2, 3], 1, 1), ([5], [6], 9, 0), ([], [1], 9, 0),
                                              (list(range(100)), list(range(63)) + [0], 99, 63)])
def test_common_prefix(a, b, limit, want):
    assert _common_prefix(a, b, limit) == want


def _tokens(engine, prompts: list[list[int]], seeds: list[int]) -> tuple[list, list[int]]:
    """Every prompt's 8 sampled tokens (temperature 1, its own seed) with each token's logprobs, submitted together;
    and each one's shared prompt tokens."""
    sink: queue.Queue = queue.Queue()
    reqs = [engine.submit(p, GenerationParams(8, 1.0, seed=s, ignore_eos=True, logprobs=2), sink=sink)
            for p, s in zip(prompts, seeds)]
    got: dict[str, list] = {r.id: [] for r in reqs}
    left = len(reqs)
    while left:
        req, event = sink.get(timeout=120)
        assert event.finish_reason != "error", event.error
        got[req.id] += list(zip(event.token_ids, event.logprobs or []))
        left -= event.finish_reason is not None
    return [got[r.id] for r in reqs], [r.shared for r in reqs]


@pytest.mark.parametrize("layout", [{}, {"tp": 2}, {"pp": 2}], ids=["one rank", "tp2", "pp2"])
def test_requests_that_share_a_prefix_sample_the_tokens_they_sample_alone(random_dirs, layout):
    """The engine's ranks: four samples of one prompt and a prompt that shares its first 30 tokens, submitted
    together (so they copy from each other's slots) and then one by one (each takes a slot that kept the prompt),
    sample with their seeds what each samples alone with sharing off, and every token's logprobs are the same
    bits."""
    from refs import plan_for
    from shardlm.engine import LocalEngine
    from shardlm.plan.plan import KVBudget

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 1001, (45,), generator=g).tolist()
    other = prompt[:30] + torch.randint(3, 1001, (12,), generator=g).tolist()
    prompts, seeds = [prompt] * 4 + [other], [11, 12, 13, 14, 15]
    plan, source = plan_for(random_dirs["gqa12x4"], kv=KVBudget(5, 96, CHUNK), **layout)
    with LocalEngine(plan, source, timeout_s=120) as engine:
        together, shared = _tokens(engine, prompts, seeds)
        later = [_tokens(engine, [p], [s]) for p, s in zip(prompts, seeds)]  # from the slots' kept prompts
        # a conversation's next turn: the prompt, its answer, more; a slot keeps the prompt, not the answer's keys
        turn = prompt + [t for t, _ in later[0][0][0]] + other[-5:]
        (turn_tokens,), (turn_shared,) = _tokens(engine, [turn], [21])
        engine.scheduler.share_prefixes = False
        alone = [_tokens(engine, [p], [s])[0][0] for p, s in zip(prompts + [turn], seeds + [21])]
    assert turn_shared == len(prompt) and turn_tokens == alone.pop()
    assert shared[0] == 0 and all(n >= MIN_SHARED for n in shared[1:]), shared  # not vacuous
    assert all(n >= MIN_SHARED for _, (n,) in later), later
    assert together == alone and [t for (t,), _ in later] == alone
    assert len({tuple(t for t, _ in row) for row in together[:4]}) > 1  # the samples differ from each other


def test_common_prefix_equals_a_plain_loop_on_random_lists():
    """Lists across the 256-token blocks, differing anywhere or nowhere, cut at any limit."""
    rng = random.Random(1)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randrange(700))]
        b = list(a)
        if b and rng.random() < 0.8:
            b[rng.randrange(len(b))] = 9
        if rng.random() < 0.3:
            b = b[:rng.randrange(len(b) + 1)]
        limit, want = rng.randrange(800), 0
        while want < min(limit, len(a), len(b)) and a[want] == b[want]:
            want += 1
        assert _common_prefix(a, b, limit) == want, (a, b, limit)
