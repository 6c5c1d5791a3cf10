"""Prefill and decode across pipeline stages, with micro-batches in flight at the same time.

The batch (left-padded to one length) is cut into m micro-batches of rows. Stage 0 embeds and
runs its layers for micro-batch 0, sends the hidden states on and starts micro-batch 1 at once,
so stages work on different micro-batches at the same time. The last stage samples each
micro-batch's next tokens and sends them back to stage 0, which feeds them in for the next step.
With m >= stages, every stage has work in steady-state decode.

Messages between consecutive stages (same tp rank): a header int64 [kind, micro-batch], then for
PREFILL and DECODE the hidden states (rows, s, dim) with s the padded prompt length or 1. Shapes
are derived from the request every rank holds, so prompts of any length and any number of decode
steps work (no static shapes). Stage 0 decides when a micro-batch is finished (end-of-sequence or
the token limit) and ends the run with a STOP header that every stage forwards.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from torch import nn

from shardlm.parallel.context import ParallelContext
from shardlm.parallel.stages import micro_batch_rows
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.rank_model import RankModel
from shardlm.runtime.sampling import row_generators
from shardlm.runtime.step import Batch, GenerationStats, Outputs, Rows, attention_mask, model_device, pick, positions_for

PREFILL, DECODE, STOP = 0, 1, 2


def _rows_of(batch: Batch, m: int, rank: RankModel, max_new_tokens: int) -> list[tuple[int, Rows]]:
    out = []
    for a, b in micro_batch_rows(batch.tokens.shape[0], m):
        out.append((a, Rows.for_model(rank, Batch(batch.tokens[a:b], batch.valid[a:b]), max_new_tokens)))
    return out


@torch.inference_mode()
def pipeline_generate(rank: RankModel, ctx: ParallelContext, batch: Batch, max_new_tokens: int,
                      params: SamplingParams, eos_ids: tuple[int, ...], micro_batches: int,
                      on_token=None, stats: GenerationStats | None = None) -> list[list[int]] | None:
    """Run this rank's stage of a pipelined generate; returns the tokens on the first and last stage, else None.

    Every rank of the pipeline calls it with the same request. `on_token(row list)` is called on the
    first stage as each micro-batch's tokens come back (-1 for rows not in it or finished).
    """
    stats = stats if stats is not None else GenerationStats()
    parts = _rows_of(batch, micro_batches, rank, max_new_tokens)
    model = rank.module
    pipe = ctx.pipe
    try:
        if pipe.is_first:
            return _first_stage(model, ctx, batch, parts, max_new_tokens, eos_ids, on_token, stats)
        return _later_stage(model, ctx, batch, parts, max_new_tokens, params, eos_ids)
    finally:
        ctx.flush()


def _send_on(ctx: ParallelContext, kind: int, mb: int, hidden: torch.Tensor | None = None) -> None:
    ctx.send(torch.tensor([kind, mb], dtype=torch.long), ctx.pipe.next, host=True)
    if hidden is not None:
        ctx.send(hidden, ctx.pipe.next)


def _first_stage(model, ctx, batch, parts, max_new_tokens, eos_ids, on_token, stats) -> list[list[int]]:
    """Stage 0: embed, run its layers, send; receive sampled tokens back and feed them in."""
    b = batch.tokens.shape[0]
    outputs = Outputs(b, eos_ids, max_new_tokens)
    t0 = time.perf_counter()
    for j, (a, rows) in enumerate(parts):
        _send_on(ctx, PREFILL, j, rows.forward(model, batch.tokens[a:a + rows.valid.shape[0]], rows.prefill_mask(),
                                               last_only=False))
    stats.prompt_tokens += int(batch.valid.sum())
    inflight, first_seen, t_prefill = deque(range(len(parts))), set(), None
    while inflight:
        j = inflight.popleft()
        a, rows = parts[j]
        n = rows.valid.shape[0]
        token = ctx.recv((n,), torch.long, ctx.pipe.last, host=True).cpu()  # (n,) sampled on the last stage
        was_done = outputs.done[a:a + n].clone()
        finished = outputs.record(a, token)
        if on_token is not None:
            on_token(outputs.stream_view(a, token, was_done))
        if j in first_seen:
            if t_prefill is not None:
                stats.decode_tokens += n
        else:
            first_seen.add(j)
            if len(first_seen) == len(parts):
                t_prefill = time.perf_counter()
        if finished:
            continue
        hidden = rows.forward(model, token[:, None], rows.next_token(), last_only=False)  # (n, 1, dim)
        _send_on(ctx, DECODE, j, hidden)
        inflight.append(j)
    _send_on(ctx, STOP, 0)
    end = time.perf_counter()
    t_prefill = t_prefill or end
    stats.prefill_s += t_prefill - t0
    stats.decode_s += end - t_prefill
    return outputs.tokens


def _later_stage(model, ctx, batch, parts, max_new_tokens, params, eos_ids) -> list[list[int]] | None:
    """Stages 1..: receive hidden states, run the layers, pass them on (or sample, on the last stage)."""
    pipe = ctx.pipe
    dim = model.args.dim
    dtype = next(model.parameters()).dtype
    outputs = Outputs(batch.tokens.shape[0], eos_ids, max_new_tokens) if pipe.is_last else None
    gens = row_generators(params.seed, batch.tokens.shape[0]) if pipe.is_last else None
    while True:
        kind, j = ctx.recv((2,), torch.long, pipe.prev, host=True).tolist()
        if kind == STOP:
            if not pipe.is_last:
                _send_on(ctx, STOP, 0)
            return outputs.tokens if outputs is not None else None
        a, rows = parts[j]
        n = rows.valid.shape[0]
        if kind == PREFILL:
            s, mask = rows.valid.shape[1], rows.prefill_mask()
        else:
            s, mask = 1, rows.next_token()
        hidden = ctx.recv((n, s, dim), dtype, pipe.prev)  # (n, s, dim) from the previous stage
        out = rows.forward(model, hidden, mask, last_only=True)
        if not pipe.is_last:
            _send_on(ctx, kind, j, out)
            continue
        token = pick(out[:, -1], params, gens[a:a + n])  # (n,)
        outputs.record(a, token)
        ctx.send(token, pipe.first, host=True)


@torch.inference_mode()
def pipeline_logits(model: nn.Module, ctx: ParallelContext, batch: Batch) -> torch.Tensor | None:
    """One forward pass of the whole padded batch through every stage, no cache: logits
    (b, s, vocab) on the last stage, None elsewhere (for parity checks and scoring)."""
    s = batch.tokens.shape[1]
    positions = positions_for(batch.valid)
    mask = attention_mask(batch.valid, 0, s, model.args.sliding_window)
    pipe = ctx.pipe
    if pipe.is_first:
        x = batch.tokens
    else:
        x = ctx.recv((batch.tokens.shape[0], s, model.args.dim), next(model.parameters()).dtype, pipe.prev)
    device = model_device(model)
    out = model(x.to(device), positions.to(device), mask.to(device))
    if not pipe.is_last:
        ctx.send(out, pipe.next)
        ctx.flush()
        return None
    return out
