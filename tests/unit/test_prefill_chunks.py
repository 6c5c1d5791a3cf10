"""Prompt chunks per step (engine/scheduler.py): anchored (what a one-GPU engine uses), a prompt's chunks are its own,
so where they start does not depend on what else is pending (on a GPU a product's rounding depends on its rows);
otherwise chunks fill each step's budget."""

from shardlm.engine.requests import GenerationParams, Request
from shardlm.engine.scheduler import Scheduler

CHUNK = 16


def _chunks(lengths: list[int], anchored: bool, slots: int = 4, steps: int = 20) -> list[list[tuple[int, int, int]]]:
    """Per step, the (request index, start, length) of each prompt chunk the scheduler plans (no decoding)."""
    s = Scheduler(slots, 256, CHUNK, eos_ids=(), anchored=anchored)
    reqs = [Request([i + 1] * n, GenerationParams(max_tokens=0)) for i, n in enumerate(lengths)]  # no common prefix
    for r in reqs:
        s.add(r)
    index = {}
    out = []
    for _ in range(steps):
        step = s.next_step()
        index.update({r.slot: i for i, r in enumerate(reqs) if r.slot is not None})
        out.append([(index[p.slot], p.start, len(p.tokens)) for p in step.prefills])
    return out


def test_anchored_chunks_start_at_multiples_of_the_chunk_whatever_is_pending():
    """A 40-token prompt is cut at 16 and 32 alone and behind other prompts."""
    alone = [c for step in _chunks([40], anchored=True) for c in step]
    assert alone == [(0, 0, 16), (0, 16, 16), (0, 32, 8)]
    behind = [c for step in _chunks([10, 40, 7], anchored=True) for c in step]
    assert [c for c in behind if c[0] == 1] == [(1, 0, 16), (1, 16, 16), (1, 32, 8)]
    assert sorted(c for c in behind if c[0] != 1) == [(0, 0, 10), (2, 0, 7)]


def test_anchored_steps_keep_the_budget_and_let_shorter_chunks_fill_the_gap():
    """A chunk that does not fit waits, a later one that fits goes, and the first prompt still prefilling always
    gets its chunk."""
    steps = _chunks([10, 40, 7, 3], anchored=True)
    assert all(sum(n for _, _, n in step) <= CHUNK for step in steps)
    assert steps[0] == [(0, 0, 10), (3, 0, 3)]  # request 1's 16 tokens and request 2's 7 do not fit in 6; 3 do
    assert steps[1] == [(1, 0, 16)]
    assert sum(n for step in steps for _, _, n in step) == 60
    assert steps[3] == [(1, 32, 8), (2, 0, 7)]  # the last of request 1's chunks and request 2 share a step
    assert not any(steps[4:])


def test_unanchored_chunks_fill_each_steps_budget():
    """CPU ranks (or SHARDLM_BATCH_INVARIANT=0): a prompt's chunk is cut short by what came before it."""
    steps = _chunks([10, 40, 7], anchored=False)
    assert steps[0] == [(0, 0, 10), (1, 0, 6)]
    assert steps[1] == [(1, 6, 16)]
    assert all(sum(n for _, _, n in step) == CHUNK for step in steps[:3])
    assert sum(n for step in steps for _, _, n in step) == 57


def test_an_unanchored_chunk_never_leaves_one_token_for_the_next():
    """A last chunk of one token runs as a decode row, whose sums are ordered otherwise than a prefill's: its
    prompt's first token would depend on the prompts before it. The chunk before leaves it two, or waits."""
    steps = _chunks([14, 3], anchored=False)
    assert steps[0] == [(0, 0, 14), (1, 0, 1)] and steps[1] == [(1, 1, 2)]
    steps = _chunks([15, 2], anchored=False)
    assert steps[0] == [(0, 0, 15)] and steps[1] == [(1, 0, 2)]


def test_a_cpu_engine_fills_the_budget_and_the_setting_reads_from_the_environment(random_dirs):
    """CPU ranks share prefill passes, so their engine does not anchor chunks (a one-GPU engine does: tests/gpu);
    SHARDLM_BATCH_INVARIANT is read from the environment (what it changes: the choose_kernels test below)."""
    from refs import plan_for
    from shardlm.engine import LocalEngine
    from shardlm.plan.plan import KVBudget
    from shardlm.settings import Settings

    assert Settings.from_env({}).batch_invariant
    assert not Settings.from_env({"SHARDLM_BATCH_INVARIANT": "0"}).batch_invariant
    plan, source = plan_for(random_dirs["gqa12x4"], kv=KVBudget(2, 64, 16))
    with LocalEngine(plan, source, timeout_s=120) as engine:
        assert [r["prefill_alone"] for r in engine.ready] == [False]
        assert not engine.scheduler.anchored


def test_an_engine_with_anchored_chunks_gives_every_request_its_tokens(random_dirs):
    """The engine's ranks and pipelined driver with anchored chunks (forced on CPU ranks): prompts of several
    chunks, prompts that wait for room and short ones that fill the gap all decode what they decode unanchored."""
    import torch

    from refs import plan_for
    from shardlm.engine import LocalEngine
    from shardlm.plan.plan import KVBudget
    from shardlm.runtime.protocol import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1001, (n,), generator=g).tolist() for n in (10, 40, 7, 3, 33, 16)]
    plan, source = plan_for(random_dirs["gqa12x4"], kv=KVBudget(4, 96, CHUNK))
    runs = {}
    for anchored in (False, True):
        with LocalEngine(plan, source, timeout_s=120) as engine:
            engine.scheduler.anchored = anchored
            runs[anchored] = engine.generate(prompts, 12, SamplingParams(), ignore_eos=True).token_ids
    assert runs[True] == runs[False]
    assert all(len(t) == 12 for t in runs[True])


def test_only_one_gpu_graph_ranks_with_the_setting_on_prefill_alone_and_then_chunks_are_anchored(random_dirs):
    """choose_kernels on a CUDA device (nothing here needs one: q/k/v stay apart): a pass per chunk only with graph
    decode (tp 1, pp 1, nothing streamed, SHARDLM_CUDA_GRAPHS on) and SHARDLM_BATCH_INVARIANT on; the engine
    anchors chunks only when every rank reports it."""
    import torch

    from refs import build, plan_for
    from shardlm.engine.service import prefill_alone
    from shardlm.runtime.build import choose_kernels
    from shardlm.settings import Settings

    folder = random_dirs["gqa12x4"]
    rank = build(folder)
    tp2 = plan_for(folder, tp=2)[0].rank_spec(0)
    cuda = torch.device("cuda")

    def alone(spec=rank.spec, streaming=False, **settings) -> bool:
        s = Settings.from_env({}, cuda_join=False, **settings)
        kernels = choose_kernels(rank.module, spec, cuda, torch.bfloat16, s, streaming, frozenset())
        return not kernels.shared_prefill

    assert alone()
    assert not alone(batch_invariant=False) and not alone(cuda_graphs=False)
    assert not alone(streaming=True) and not alone(spec=tp2)
    assert prefill_alone([{"prefill_alone": True}])
    assert not prefill_alone([{"prefill_alone": True}, {"prefill_alone": False}]) and not prefill_alone([{}])
