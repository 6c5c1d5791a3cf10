"""Reference outputs from transformers and the same outputs from shardlm ranks, for parity tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.models.args import read_config
from shardlm.models.registry import args_for_config
from shardlm.parallel.context import ParallelContext
from shardlm.runtime.load import build_rank_model, shard_coord
from shardlm.runtime.messages import SamplingParams
from shardlm.runtime.step import Batch, attention_mask, generate, positions_for


@torch.no_grad()
def hf_logits_and_tokens(model, prompts: list[list[int]], n_new: int) -> tuple[torch.Tensor, list[list[int]]]:
    """transformers logits (b, s, vocab) over the left-padded batch and greedy continuations."""
    batch = Batch.from_lists(prompts)
    mask = batch.valid.long()
    logits = model(input_ids=batch.tokens, attention_mask=mask, position_ids=positions_for(batch.valid)).logits
    out = model.generate(input_ids=batch.tokens, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return logits.float(), out[:, batch.tokens.shape[1]:].tolist()


@torch.no_grad()
def shardlm_rank(rank: int, world: int, folder: str, prompts: list[list[int]], n_new: int, shm: bool):
    """On one rank: full logits over the padded batch and greedy continuations (no eos stop)."""
    family, args = args_for_config(read_config(folder))
    coll = None
    if shm and world > 1:
        from shardlm.parallel.shm import ShmCollectives

        coll = ShmCollectives.from_group(dist.group.WORLD, 8 * 2**20, timeout_s=60)
    ctx = ParallelContext(rank=rank, world=world, shm=coll)
    coord = shard_coord(args, rank, world)
    model = build_rank_model(folder, family, args, coord, ctx)
    batch = Batch.from_lists(prompts)
    s = batch.tokens.shape[1]
    logits = model(batch.tokens, positions_for(batch.valid), attention_mask(batch.valid, 0, s, args.sliding_window))
    tokens = generate(model, batch, n_new, SamplingParams(), (), coord.local_kv_heads())
    if coll is not None:
        coll.close()
    return (logits if rank == 0 else None), tokens, ctx.snapshot()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor, rel: float = 1e-4) -> float:
    """Max abs difference over valid positions must be <= rel * max |ref logit|; returns the ratio."""
    diff = (ours - ref)[valid].abs().max().item()
    scale = ref[valid].abs().max().item()
    assert diff <= rel * scale, f"max |logit diff| {diff:.3g} > {rel} x max |logit| {scale:.3g}"
    return diff / scale


@torch.no_grad()
def shardlm_stage_rank(rank: int, world: int, folder: str, prompts: list[list[int]], n_new: int, tp: int,
                       counts: list[int], micro_batches: int, sampling: SamplingParams = SamplingParams(),
                       device: str = "cpu"):
    """On one rank of tp x len(counts) ranks: logits (last stage's rank 0 only), tokens and comms.
    `device` "cuda" puts every rank on GPU rank mod the GPUs (the group's backend as launched)."""
    from shardlm.parallel.stages import StageSpec, stages_from_counts
    from shardlm.parallel.pipeline import pipeline_context
    from shardlm.runtime.pipeline_step import pipeline_generate, pipeline_logits

    family, args = args_for_config(read_config(folder))
    nccl = dist.get_backend() == "nccl"
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    ctx = pipeline_context(rank, tp, len(counts), 0 if nccl else 8 * 2**20, timeout_s=60, nccl=nccl)
    coord = shard_coord(args, ctx.rank, tp)
    stage = StageSpec.of(stages_from_counts(counts), ctx.pipe.stage) if ctx.pipe else None
    model = build_rank_model(folder, family, args, coord, ctx, device=device, stage=stage)
    batch = Batch.from_lists(prompts)
    if ctx.pipe is None:
        s = batch.tokens.shape[1]
        inputs = (batch.tokens, positions_for(batch.valid), attention_mask(batch.valid, 0, s, args.sliding_window))
        logits = model(*(t.to(device) for t in inputs))
        tokens = generate(model, batch, n_new, sampling, (), coord.local_kv_heads())
    else:
        logits = pipeline_logits(model, ctx, batch)
        tokens = pipeline_generate(model, ctx, batch, n_new, sampling, (), coord.local_kv_heads(), micro_batches)
    if ctx.shm is not None:
        ctx.shm.close()
    logits = logits.cpu() if logits is not None else None
    keep = logits is not None and ctx.rank == 0
    params = sorted(n for n, _ in model.named_parameters())
    return (logits if keep else None), tokens, ctx.snapshot(), params
