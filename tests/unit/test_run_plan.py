"""The Plan of a run: flags build it through the planner, and every rank's RankSpec comes from it."""

import pytest

from shardlm.models.presets import preset_config
from shardlm.models.registry import args_for_config
from shardlm.plan.make import load_model
from shardlm.plan.memory import shard_weights
from shardlm.plan.plan import KVBudget, PlanError
from shardlm.plan.run import RunFlags, plan_for_run
from shardlm.plan.streaming import BudgetError, fit_budget, resident_bytes

MiB = 2**20


def _plan(model="smollm2-135m", kv=KVBudget(2, 64, 32), **flags):
    ref, fam, args = load_model(model)
    return plan_for_run(ref, fam, args, RunFlags(**flags), kv)


def test_flags_build_a_predicted_plan_with_the_runtime_defaults():
    plan = _plan()
    assert (plan.layout.tp, plan.layout.pp, plan.layout.stage_layers) == (1, 1, ((0, 30),))
    assert (plan.dtype, plan.quantization, plan.device, plan.kv) == ("float32", "none", "cpu", KVBudget(2, 64, 32))
    mem = plan.predictions.memory[0]
    assert 500 * MiB < mem.weights < 560 * MiB  # 134.5 M float32 parameters, tied head counted once
    assert plan.predictions.performance.decode_tokens_per_s > 0


def test_rank_specs_give_coordinates_layers_and_neighbours():
    plan = _plan(tp=2, pp=3, layers=(12, 10, 8), micro_batches=2, quantization="int8")
    specs = [plan.rank_spec(r) for r in range(plan.world)]
    assert [(s.stage, s.tp_rank) for s in specs] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [s.layers for s in specs[::2]] == [(0, 12), (12, 22), (22, 30)]
    mid = specs[3]  # stage 1, tp rank 1
    assert (mid.prev, mid.next, mid.first, mid.last, mid.tp_group) == (1, 5, 1, 5, (2, 3))
    assert specs[0].prev is None and specs[5].next is None and specs[0].first_stage and specs[5].last_stage
    assert all(s.quantization == "int8" and s.micro_batches == 2 and s.world == 6 for s in specs)
    assert specs[0].tp_groups == ((0, 1), (2, 3), (4, 5))


@pytest.mark.parametrize("flags,expect", [
    (dict(tp=10), "use --tp 9"), (dict(tp=0), "use --tp 1"), (dict(pp=31), "use --pp 30"), (dict(pp=0), "use --pp 1"),
    (dict(pp=2, layers=(20, 20)), "sums to 40"), (dict(pp=2, layers=(10, 10, 10)), "gives 3 stage(s) but --pp is 2"),
    (dict(pp=2, micro_batches=3), "use --micro-batches 2"), (dict(micro_batches=2), "only applies to pipeline"),
    (dict(dtype="float16"), "--dtype float16 is not supported"), (dict(device="tpu"), "--device tpu"),
    (dict(quantization="int3"), "use none, int8 or int4"), (dict(offload_dir="/tmp"), "only apply with --memory"),
    (dict(memory_budget=20 * MiB), "needs at least"),
])
def test_bad_flags_are_refused_with_the_accepted_range(flags, expect):
    with pytest.raises(PlanError, match=None) as info:
        _plan(**flags)
    assert expect in str(info.value)


def test_a_model_that_does_not_fit_names_the_memory():
    with pytest.raises(PlanError, match="GiB is available"):
        _plan("llama-3.1-70b")


def test_memory_budget_streams_the_last_layers_of_each_stage():
    plan = _plan(memory_budget=250 * MiB)
    spec = plan.rank_spec(0)
    assert spec.offload.tier == "disk" and 0 < spec.offload.layers < 30 and not spec.offload.vocab
    assert plan.predictions.memory[0].weights <= 250 * MiB
    tiny = _plan(memory_budget=40 * MiB, pp=2)  # below the 108 MiB embedding / tied head: used in place
    assert all(tiny.rank_spec(r).offload.vocab for r in range(2))
    assert all(m.weights <= 40 * MiB for m in tiny.predictions.memory)


def test_fit_budget_is_the_resident_bytes_rule():
    fam, args = args_for_config(preset_config("llama-3.2-1b"))
    w = shard_weights(args, fam.tp_plan, 1, 0, "bfloat16", "none")
    for budget in (900 * MiB, 1500 * MiB, 3 * 2**30):
        fit = fit_budget(w, args.n_layers, True, True, budget, True, False)
        assert fit.resident <= budget
        assert fit.resident == resident_bytes(w, args.n_layers, True, True, fit.streamed, fit.vocab, 2, False)
        if fit.streamed:  # one layer fewer streamed would not fit
            fewer = resident_bytes(w, args.n_layers, True, True, fit.streamed - 1, fit.vocab, 2, False)
            assert fewer > budget or fit.streamed == 1
    with pytest.raises(BudgetError, match="below the"):
        fit_budget(w, args.n_layers, True, True, 10 * MiB, True, False, vocab_ok=False)
