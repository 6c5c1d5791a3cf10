"""A serving rank's step (runtime/serve_step.py): prefill chunks of several slots share one forward pass,
right-padded, and every row's tokens, logprobs and cached keys equal those of the chunk run alone."""

import pytest
import torch

from refs import build
from shardlm.parallel.context import ParallelContext
from shardlm.plan.plan import KVBudget
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.serve_step import SlotRunner, prefill_groups
from shardlm.runtime.work import Decode, Prefill, SlotStart, Step
from shardlm.settings import Settings

GREEDY = SamplingParams()


def _prefill(slot: int, tokens: list[int], start: int = 0, sample: bool = True, echo: bool = False) -> Prefill:
    return Prefill(slot, tuple(tokens), start, sample, GREEDY, logprobs=2, prompt_logprobs=echo)


def test_prefill_groups_share_a_pass_within_the_padding_bound():
    short, mid, long = _prefill(0, [1] * 3), _prefill(1, [1] * 4), _prefill(2, [1] * 40)
    assert [[p.slot for p in g] for g in prefill_groups([long, short, mid], 128)] == [[0, 1], [2]]
    echo = _prefill(3, [1] * 4, echo=True)  # wants every position's logits: runs alone
    assert [[p.slot for p in g] for g in prefill_groups([short, echo, mid], 128)] == [[3], [0, 1]]
    near_end = _prefill(4, [1] * 3, start=125)  # padded to 4 it would pass the slot's end (128)
    assert [[p.slot for p in g] for g in prefill_groups([near_end, mid], 128)] == [[4], [1]]
    assert prefill_groups([], 128) == []


def _runner(folder, slots: int = 4) -> SlotRunner:
    rank = build(folder, kv=KVBudget(slots, 64, 64))
    return SlotRunner(rank, ParallelContext())


def _cached(runner: SlotRunner, slot: int, length: int) -> list[torch.Tensor]:
    return [c[layer][slot, :, :length] for c in (runner.cache.k, runner.cache.v) for layer in c]


@pytest.mark.parametrize("name", ["gqa12x4", "mistral_window"])
def test_batched_prefill_rows_equal_each_row_alone(random_dirs, name):
    """Three prompts of different lengths in two chunks each, then decode: in one pass per step, or alone."""
    prompts = [list(range(5, 16)), list(range(40, 53)), list(range(100, 109))]  # 11, 13, 9 tokens
    split = [6, 4, 9]  # first chunk lengths; the third prompt fits in one chunk
    together, alone = _runner(random_dirs[name]), _runner(random_dirs[name])
    starts = tuple(SlotStart(slot, 7) for slot in range(3))
    first = [_prefill(s, p[:n], sample=n == len(p)) for s, (p, n) in enumerate(zip(prompts, split))]
    second = [_prefill(s, p[n:], start=n) for s, (p, n) in enumerate(zip(prompts, split)) if n < len(p)]
    got, want = {}, {}
    for i, chunks in enumerate((first, second)):
        got.update(together.run(Step(i, starts if i == 0 else (), tuple(chunks))).slots)
        for j, p in enumerate(chunks):
            want.update(alone.run(Step(10 * i + j, starts if i == 0 and j == 0 else (), (p,))).slots)
    assert {s: g.token for s, g in got.items()} == {s: w.token for s, w in want.items()}
    for s in got:
        assert got[s].logprob["token_logprob"] == pytest.approx(want[s].logprob["token_logprob"], abs=1e-5)
    for slot, p in enumerate(prompts):
        for a, b in zip(_cached(together, slot, len(p)), _cached(alone, slot, len(p))):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    tokens = {s: got[s].token for s in got}
    for i in range(3):  # decode on top of the padded prefill: the padding was overwritten, never read
        decodes = tuple(Decode(s, tokens[s], len(prompts[s]) + i, GREEDY) for s in range(3))
        a = together.run(Step(100 + i, (), (), decodes)).slots
        b = alone.run(Step(100 + i, (), (), decodes)).slots
        assert {s: x.token for s, x in a.items()} == {s: x.token for s, x in b.items()}
        tokens = {s: a[s].token for s in a}


def test_a_rank_without_shared_prefill_keeps_each_prompts_cache_its_own(random_dirs, monkeypatch):
    """GPU ranks (SHARDLM_BATCH_INVARIANT, the default) run each chunk in a pass of its own. With products whose
    rounding depends on how many rows they hold (as cuBLAS's do; stood in here by scaling with the row count), a
    prompt's cached keys and values are then those of the prompt prefilled alone; in a shared pass they are not."""
    from dataclasses import replace

    import torch.nn.functional as F

    real = F.linear

    def by_rows(x, w, b=None):  # a product whose rounding depends on its row count
        return real(x, w, b) * (1 + 1e-3 * ((x.numel() // x.shape[-1]) % 5))

    monkeypatch.setattr(torch.nn.functional, "linear", by_rows)
    rank = build(random_dirs["gqa12x4"], kv=KVBudget(4, 64, 64), settings=Settings(kernels="torch"))
    prompts = {0: [5, 9, 13], 1: [6, 8, 10, 12], 2: [7, 11, 15, 17]}
    chunks = tuple(_prefill(slot, p) for slot, p in prompts.items())
    starts = tuple(SlotStart(slot, 7) for slot in prompts)

    def cached(shared: bool, together: bool) -> list[list[torch.Tensor]]:
        rank.kernels = replace(rank.kernels, shared_prefill=shared)
        runner = SlotRunner(rank, ParallelContext())
        if together:
            assert len(runner._items(Step(1, starts, chunks))) == (1 if shared else 3)
            runner.run(Step(1, starts, chunks))
        else:
            for i, c in enumerate(chunks):
                runner.run(Step(i, (starts[i],), (c,)))
        return [_cached(runner, slot, len(p)) for slot, p in prompts.items()]

    alone = cached(shared=True, together=False)
    for shared, same in ((False, True), (True, False)):
        got = cached(shared, together=True)
        equal = all(torch.equal(a, b) for g, w in zip(got, alone) for a, b in zip(g, w))
        assert equal == same, f"shared passes {shared}: cache equal to the prompts alone {equal}"


def _decode_logits(runner: SlotRunner, slots: list[int], tokens: dict, positions: dict, step_id: int):
    """One decode step of `slots`; each row's logits (vocab,), captured where the runner samples (the Python step:
    a compiled greedy run, runtime/greedy_run.py, keeps its logits to itself)."""
    got = []
    sample, greedy = runner._sample, runner.greedy

    def capture(item, logits):
        got.append(logits[:, -1].clone())
        return sample(item, logits)

    runner._sample, runner.greedy = capture, None
    try:
        runner.run(Step(step_id, (), (), tuple(Decode(s, tokens[s], positions[s], GREEDY) for s in slots)))
    finally:
        runner._sample, runner.greedy = sample, greedy
    return {s: row for s, row in zip(slots, torch.cat(got))}


@pytest.fixture
def torch_threads():
    """Set torch's thread count for one test (restored after it)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("name,threads", [("gqa12x4", 2), ("mistral_window", 2), ("gqa12x4", 3), ("gqa12x4", 1)])
def test_decode_rows_of_different_lengths_equal_each_row_alone_bit_for_bit(random_dirs, name, threads, torch_threads):
    """Each decode row attends over its own span of the cache only (csrc/attend.h allowed_span; with a sliding
    window the span starts past 0): a short row beside long ones gives the very logits it gives alone, however the
    threads split the rows by cost (one long row first, short rows after it, one long row last)."""
    torch_threads(threads)
    lengths = [58, 3, 29, 4, 5, 61]  # mistral_window's window is shorter than the longest
    rows = list(range(len(lengths)))
    prompts = [[(11 * s + 3 * j) % 200 + 5 for j in range(n)] for s, n in enumerate(lengths)]
    together, alone = _runner(random_dirs[name], len(rows)), _runner(random_dirs[name], len(rows))
    starts = tuple(SlotStart(s, 7) for s in rows)
    first = tuple(_prefill(s, p) for s, p in enumerate(prompts))
    tokens = {s: w.token for s, w in together.run(Step(0, starts, first)).slots.items()}
    alone.run(Step(0, starts, first))
    positions = {s: n for s, n in enumerate(lengths)}
    for i in range(3):
        a = _decode_logits(together, rows, tokens, positions, 10 + i)
        for s in rows:
            b = _decode_logits(alone, [s], tokens, positions, 20 + len(rows) * i + s)
            assert torch.equal(a[s], b[s]), f"row {s} (length {positions[s]}) differs beside other rows"
        tokens = {s: int(a[s].argmax()) for s in rows}
        positions = {s: p + 1 for s, p in positions.items()}
