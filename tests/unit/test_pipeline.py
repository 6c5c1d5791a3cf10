"""Pipeline pieces in one process: stage models chained by hand equal the whole model; micro-batch rules."""

import pytest
import torch

from refs import build, plan_for
from shardlm.parallel.stages import StageSpec, auto_micro_batches, even_stages, micro_batch_rows, stages_from_counts
from shardlm.runtime.build import build_rank_model
from shardlm.parallel.context import ParallelContext
from shardlm.runtime.step import Batch, Outputs, attention_mask, positions_for


def test_micro_batch_rows_cover_the_batch_nearly_evenly():
    assert micro_batch_rows(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert micro_batch_rows(1, 1) == [(0, 1)]
    with pytest.raises(ValueError):
        micro_batch_rows(2, 3)


def test_auto_micro_batches_is_one_per_stage_capped_by_the_batch():
    assert auto_micro_batches(8, 2) == 2
    assert auto_micro_batches(1, 4) == 1
    assert auto_micro_batches(3, 4) == 3


def test_stage_ranges():
    assert stages_from_counts([20, 10]) == ((0, 20), (20, 30))
    assert even_stages(30, 4) == ((0, 8), (8, 16), (16, 23), (23, 30))
    assert StageSpec.of(((0, 20), (20, 30)), 1) == StageSpec(20, 30, first=False, last=True)


def test_outputs_stop_at_eos_and_the_token_limit():
    out = Outputs(3, eos_ids=(2,), max_new_tokens=2)
    assert not out.record(0, torch.tensor([5, 2, 7]))
    assert out.record(0, torch.tensor([6, 9, 8]))
    assert out.tokens == [[5, 6], [2], [7, 8]]


@pytest.mark.parametrize("name,counts", [("qwen2", (1, 1)), ("gqa12x4", (1, 2)), ("gqa12x4", (1, 1, 1))])
def test_chained_stages_equal_the_whole_model(random_dirs, name, counts):
    folder = random_dirs[name]
    whole = build(folder)
    args = whole.args
    plan, source = plan_for(folder, pp=len(counts), layers=counts)
    assert plan.layout.stage_layers == stages_from_counts(counts)
    stages = [build_rank_model(plan.rank_spec(i), source, ParallelContext()) for i in range(len(counts))]
    batch = Batch.from_lists([[5, 9, 11, 3, 8], [7, 4]])
    pos, mask = positions_for(batch.valid), attention_mask(batch.valid, 0, 5, args.sliding_window)
    x = batch.tokens
    for stage in stages:
        x = stage(x, pos, mask)
    assert torch.equal(x, whole(batch.tokens, pos, mask))
    held = [sum(p.numel() for p in s.module.parameters()) for s in stages]
    tied_head = args.vocab_size * args.dim if args.tie_embeddings else 0
    assert sum(held) == sum(p.numel() for p in whole.module.parameters()) + tied_head  # each stage only its part
