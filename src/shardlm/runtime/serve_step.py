"""Run one engine step on a rank: prefill chunks and decode tokens in KV-cache slots, sample, report.

Every rank of the plan runs the same Step (the driver hands it to each). Work items run in order: each
prefill chunk alone (one slot), then the decode rows as micro-batches (one group without pipeline
stages). With stages, stage 0 embeds an item, runs its layers and sends the hidden states on without
waiting, so the stages work on different items at the same time; the last stage samples. Rows sample
with their own request's settings and random stream (seeded when the request took its slot), so a
request's tokens do not depend on the rows beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardlm.parallel.context import ParallelContext
from shardlm.parallel.stages import micro_batch_rows
from shardlm.runtime.rank_model import RankModel
from shardlm.runtime.slots import SlotCache, SlotRun
from shardlm.runtime.step import pick
from shardlm.runtime.work import Decode, Prefill, Sampled, Step, StepResult


STEP_BOUNDS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the step-time histogram each rank keeps for /metrics."""


class StepClock:
    """A histogram of step times, kept on the rank (a few integer adds per step) and read by stats."""

    def __init__(self, bounds: tuple[float, ...] = STEP_BOUNDS):
        self.bounds, self.counts = bounds, [0] * len(bounds)
        self.count, self.sum = 0, 0.0

    def add(self, seconds: float) -> None:
        """Count one step."""
        self.count += 1
        self.sum += seconds
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1
                return

    def as_dict(self) -> dict:
        """Bounds, per-bucket counts (not cumulative), count and sum."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "count": self.count, "sum": self.sum}


@dataclass
class _Item:
    """One forward pass of a step: its inputs and the work records it serves."""

    tokens: torch.Tensor
    """(b, s) token ids."""
    positions: torch.Tensor
    """(b, s) rotary positions."""
    mask: torch.Tensor
    """(b, 1, s, t) bool."""
    run: SlotRun
    work: list
    """The Prefill (one) or Decode records (one per row)."""
    full_logits: bool


def decode_mask(positions: list[int], window: int | None) -> torch.Tensor:
    """(b, 1, 1, t) for one new token per row at its own position: a row sees its own earlier keys."""
    p = torch.tensor(positions)[:, None]  # (b, 1)
    k = torch.arange(max(positions) + 1)[None, :]  # (1, t)
    allowed = k <= p
    if window is not None:
        allowed &= k > p - window
    return allowed[:, None, None, :]  # (b, 1, 1, t)


def prefill_mask(start: int, length: int, window: int | None) -> torch.Tensor:
    """(1, 1, s, start + s): a chunk's queries at [start, start + s) see every earlier key (causal)."""
    q = torch.arange(start, start + length)[:, None]  # (s, 1)
    k = torch.arange(start + length)[None, :]  # (1, t)
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed[None, None]  # (1, 1, s, t)


class SlotRunner:
    """A serving rank's state between steps: its KV-cache slots and each slot's random stream."""

    def __init__(self, rank: RankModel, ctx: ParallelContext):
        kv, args = rank.spec.kv, rank.args
        self.rank, self.ctx = rank, ctx
        self.cache = SlotCache(rank.layer_ids, kv.max_batch, rank.kv_heads, kv.max_seq_len, args.head_dim, rank.dtype,
                               rank.device)
        self.generators: dict[int, torch.Generator] = {}
        self.window = args.sliding_window
        spec = rank.spec
        self.first, self.last = spec.first_stage, spec.last_stage
        self.micro_batches = spec.micro_batches
        self.clock = StepClock()

    @property
    def reports(self) -> bool:
        """Whether this rank reports the step's tokens to the driver (tp rank 0 of the last stage)."""
        return self.last and self.rank.spec.tp_rank == 0

    @torch.inference_mode()
    def run(self, step: Step) -> StepResult | None:
        """Run `step`; returns its result on the reporting rank, None elsewhere."""
        t0 = time.perf_counter()
        for s in step.starts:
            self.generators[s.slot] = torch.Generator().manual_seed(s.seed)
        out: dict[int, Sampled] = {}
        try:
            for item in self._items(step):
                logits = self._forward(item)
                if logits is not None:
                    out.update(self._sample(item, logits))
        finally:
            self.ctx.flush()
        seconds = time.perf_counter() - t0
        self.clock.add(seconds)
        return StepResult(step.id, out, seconds) if self.reports else None

    def _items(self, step: Step) -> list[_Item]:
        items = []
        for p in step.prefills:
            n = len(p.tokens)
            positions = torch.arange(p.start, p.start + n)[None]  # (1, s)
            items.append(_Item(torch.tensor([p.tokens]), positions, prefill_mask(p.start, n, self.window),
                               self.cache.prefill(p.slot, p.start, n), [p], p.prompt_logprobs))
        decodes = list(step.decodes)
        groups = min(len(decodes), self.micro_batches or self.rank.spec.pp)
        for a, b in (micro_batch_rows(len(decodes), groups) if decodes else []):
            part = decodes[a:b]
            pos = [d.position for d in part]
            items.append(_Item(torch.tensor([[d.token] for d in part]), torch.tensor(pos)[:, None],
                               decode_mask(pos, self.window), self.cache.decode([d.slot for d in part], pos), part,
                               False))
        return items

    def _forward(self, item: _Item) -> torch.Tensor | None:
        """This stage's part of one item: logits (b, s or 1, vocab) on the last stage, else None."""
        ctx, dev, model = self.ctx, self.rank.device, self.rank.module
        b, s = item.tokens.shape
        if self.first:
            x = item.tokens
        else:
            x = ctx.recv((b, s, self.rank.args.dim), self.rank.dtype, ctx.pipe.prev)  # (b, s, dim)
        if dev.type != "cpu":
            x, positions, mask = (t.to(dev, non_blocking=True) for t in (x, item.positions, item.mask))
        else:
            positions, mask = item.positions, item.mask
        out = model(x, positions, mask, item.run, last_only=not item.full_logits)
        if not self.last:
            ctx.send(out, ctx.pipe.next)
            return None
        return out

    def _sample(self, item: _Item, logits: torch.Tensor) -> dict[int, Sampled]:
        """Each row's next token (with its logprobs when asked), and a prefill's prompt logprobs."""
        out = {}
        last = logits[:, -1]  # (b, vocab)
        for j, w in enumerate(item.work):
            got = Sampled()
            if isinstance(w, Prefill) and w.prompt_logprobs:
                got.prompt_logprobs = _prompt_logprobs(logits[0], w)
            if isinstance(w, Decode) or w.sample:
                row = last[j:j + 1]  # (1, vocab)
                gen = self.generators[w.slot]
                got.token = int(pick(row, w.params, [gen])[0])
                if w.logprobs is not None:
                    got.logprob = _logprob(row[0], got.token, w.logprobs)
            out[w.slot] = got
        return out


def _logprob(logits: torch.Tensor, token: int, top: int) -> dict:
    """{"token_logprob", "top": {id: logprob}} of `token` under logits (vocab,)."""
    lp = torch.log_softmax(logits.float().cpu(), dim=-1)
    best = torch.topk(lp, top) if top > 0 else None
    return {"token_logprob": float(lp[token]),
            "top": {int(i): float(v) for v, i in zip(best.values, best.indices)} if best is not None else {}}


def _prompt_logprobs(logits: torch.Tensor, p: Prefill) -> list[dict]:
    """For each position of a chunk (logits (s, vocab)): the logprob of the token that follows it in the prompt,
    with the top-1 alternative (what lm-eval's loglikelihood reads)."""
    nxt = list(p.tokens[1:]) + ([p.next_token] if p.next_token is not None else [])
    lp = torch.log_softmax(logits[:len(nxt)].float().cpu(), dim=-1)  # (n, vocab)
    top = lp.max(dim=-1)
    return [{"token": t, "token_logprob": float(lp[i, t]), "top": {int(top.indices[i]): float(top.values[i])}}
            for i, t in enumerate(nxt)]
