"""A prompt's prefill chunks are its own (engine/scheduler.py): where they start does not depend on what else is
pending, so a chunk's numbers cannot depend on it either (on a GPU a product's rounding depends on its rows)."""

from shardlm.engine.requests import GenerationParams, Request
from shardlm.engine.scheduler import Scheduler

CHUNK = 16


def _chunks(lengths: list[int], slots: int = 4, steps: int = 20) -> list[list[tuple[int, int, int]]]:
    """Per step, the (request index, start, length) of each prompt chunk the scheduler plans (no decoding)."""
    s = Scheduler(slots, 256, CHUNK, eos_ids=())
    reqs = [Request([5] * n, GenerationParams(max_tokens=0)) for n in lengths]
    for r in reqs:
        s.add(r)
    index = {}
    out = []
    for _ in range(steps):
        step = s.next_step()
        index.update({r.slot: i for i, r in enumerate(reqs) if r.slot is not None})
        out.append([(index[p.slot], p.start, len(p.tokens)) for p in step.prefills])
    return out


def test_a_prompts_chunks_start_at_multiples_of_the_chunk_whatever_is_pending():
    alone = [c for step in _chunks([40]) for c in step]
    assert alone == [(0, 0, 16), (0, 16, 16), (0, 32, 8)]
    behind = [c for step in _chunks([10, 40, 7]) for c in step]
    assert [c for c in behind if c[0] == 1] == [(1, 0, 16), (1, 16, 16), (1, 32, 8)]
    assert sorted(c for c in behind if c[0] != 1) == [(0, 0, 10), (2, 0, 7)]


def test_a_step_never_spends_more_than_its_budget_and_keeps_admission_order():
    steps = _chunks([10, 40, 7, 3])
    assert all(sum(n for _, _, n in step) <= CHUNK for step in steps)
    assert steps[0] == [(0, 0, 10)]  # request 1's first chunk (16) waits: 6 tokens are left, and so do 2 and 3
    firsts = [next(i for i, step in enumerate(steps) if any(c[0] == r for c in step)) for r in range(4)]
    assert firsts == sorted(firsts)
    assert sum(n for step in steps for _, _, n in step) == 60
