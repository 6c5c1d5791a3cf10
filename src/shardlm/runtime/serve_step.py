"""Run one engine step on a rank: prefill chunks and decode tokens in KV-cache slots, sample, report.

Every rank of the plan runs the same Step (the driver hands it to each). Work items run in order: the
prefill chunks, several slots per forward pass (right-padded to one width, see `prefill_groups`; on a one-GPU
rank with CUDA-graph decode each chunk in its own pass unless SHARDLM_BATCH_INVARIANT=0, as cuBLAS picks its
kernels, and so a row's rounding, by the rows a product holds: bench/RESULTS.md, "GPU: run-ahead and batch
invariance on an H100"), then the decode rows as micro-batches (one group without pipeline stages; a CUDA graph
replay on a one-GPU rank, runtime/slot_graphs.py). With stages, stage 0 embeds an item, runs its layers and
sends the hidden states on without waiting, so the stages work on different items at the same time; the last
stage samples. Rows sample with their own request's settings and random stream (seeded when the request took its
slot), so a request's tokens do not depend on the rows beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardlm.parallel.context import ParallelContext
from shardlm.parallel.stages import micro_batch_rows
from shardlm.runtime.ahead import RunAhead
from shardlm.runtime.greedy_run import GreedyRuns
from shardlm.runtime.rank_model import RankModel
from shardlm.runtime.slot_graphs import SlotGraphs, deterministic_attention
from shardlm.runtime.slots import SlotCache, SlotRun
from shardlm.runtime.step import pick
from shardlm.runtime.work import Decode, Prefill, Sampled, Step, StepResult


PAD_WASTE = 1.5
"""Prefill chunks share a forward pass while their padded tokens are at most this many times the real ones."""

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
    """The Prefill or Decode records, one per row."""
    full_logits: bool
    last: torch.Tensor | None = None
    """(b,) each row's last real token, for right-padded prefill rows (None: the last position)."""


def decode_mask(positions: list[int], window: int | None) -> torch.Tensor:
    """(b, 1, 1, t) for one new token per row at its own position: a row sees its own earlier keys."""
    p = torch.tensor(positions)[:, None]  # (b, 1)
    k = torch.arange(max(positions) + 1)[None, :]  # (1, t)
    allowed = k <= p
    if window is not None:
        allowed &= k > p - window
    return allowed[:, None, None, :]  # (b, 1, 1, t)


def prefill_mask(starts: list[int], width: int, window: int | None) -> torch.Tensor:
    """(b, 1, s, t) for chunks of s = `width` tokens, row j's queries at [starts[j], starts[j] + s): each sees
    every earlier key of its own slot (causal); t = max(starts) + s."""
    q = torch.tensor(starts)[:, None] + torch.arange(width)[None, :]  # (b, s) query positions
    k = torch.arange(max(starts) + width)  # (t,)
    allowed = k[None, None, :] <= q[:, :, None]  # (b, s, t)
    if window is not None:
        allowed &= k[None, None, :] > q[:, :, None] - window
    return allowed[:, None]  # (b, 1, s, t)


def prefill_groups(prefills, max_len: int) -> list[list[Prefill]]:
    """The prefill chunks of a step as forward passes: a chunk that wants its prompt logprobs runs alone; the
    others, shortest first, share a pass while the padded tokens stay within PAD_WASTE x the real ones and
    every row's padded end fits its slot (`max_len`)."""
    groups = [[p] for p in prefills if p.prompt_logprobs]
    group: list[Prefill] = []
    for p in sorted((p for p in prefills if not p.prompt_logprobs), key=lambda p: len(p.tokens)):
        width, trial = len(p.tokens), group + [p]
        real = sum(len(q.tokens) for q in trial)
        if group and (width * len(trial) > PAD_WASTE * real or max(q.start for q in trial) + width > max_len):
            groups.append(group)
            trial = [p]
        group = trial
    return groups + ([group] if group else [])


class SlotRunner:
    """A serving rank's state between steps: its KV-cache slots and each slot's random stream."""

    def __init__(self, rank: RankModel, ctx: ParallelContext):
        kv, args = rank.spec.kv, rank.args
        self.rank, self.ctx = rank, ctx
        self.cache = SlotCache(rank.layer_ids, kv.max_batch, rank.kv_heads, kv.max_seq_len, args.head_dim, rank.dtype,
                               rank.device)
        self.generators: dict[int, torch.Generator] = {}
        self.sampled: dict[int, int] = {}
        """Each slot's last sampled token, for a Decode whose token is None (the driver has not seen it yet)."""
        self.window = args.sliding_window
        spec = rank.spec
        self.first, self.last = spec.first_stage, spec.last_stage
        self.micro_batches = spec.micro_batches
        self.clock = StepClock()
        self.graphs = SlotGraphs(rank.module, self.cache, self.window) \
            if rank.kernels.cuda_graphs and rank.device.type == "cuda" else None
        """Decode steps as CUDA graph replays on a one-GPU rank (runtime/slot_graphs.py)."""
        if self.graphs is not None and not rank.kernels.shared_prefill:
            deterministic_attention()  # the same logits run to run and row to row (runtime/slot_graphs.py)
        self.ahead = RunAhead(self) if self.graphs is not None and rank.kernels.run_ahead else None
        """Greedy decode steps launched before the step ahead of them is read (runtime/ahead.py)."""
        self.greedy = GreedyRuns.of(rank, self.cache, self.window)
        """Runs of greedy decode tokens in one compiled call (runtime/greedy_run.py), where the rank takes them."""
        self._argmax = rank.ops.argmax_rows if rank.ops is not None and rank.device.type == "cpu" else _torch_argmax
        """Each row's argmax of float32 logits (b, vocab) -> (b,): the compiled kernels' (csrc/argmax.h: torch's
        result, in both threads), else torch's."""
        self._draw_ops = rank.ops if rank.ops is not None and hasattr(rank.ops, "draw_rows") else None
        """The compiled kernels for sampling's draw (csrc/draw.h), where this rank has them."""

    @property
    def reports(self) -> bool:
        """Whether this rank reports the step's tokens to the driver (tp rank 0 of the last stage)."""
        return self.last and self.rank.spec.tp_rank == 0

    @torch.inference_mode()
    def run(self, step: Step) -> StepResult | None:
        """Run `step` (its decode rows `step.repeat` times); returns its result on the reporting rank, None
        elsewhere. The clock counts each decode run as a step of its own."""
        t0 = mark = time.perf_counter()
        for s in step.starts:
            self.generators[s.slot] = torch.Generator().manual_seed(s.seed)
            self.sampled.pop(s.slot, None)
        for c in step.copies:
            self.cache.copy(c.src, c.dst, c.start, c.end)
        out: dict[int, Sampled] = {}
        later: list[dict[int, Sampled]] = []
        try:
            tokens = self._compiled(step)
            if tokens is not None:  # every run of a step of greedy decode rows, in one call
                mark = self._spread(list(step.decodes), tokens, mark, out, later)
            else:
                self._run_items(self._items(step), out)
                mark = self._repeat(step, mark, later)
        finally:
            self.ctx.flush()
        seconds = self._tick(mark) - t0
        return StepResult(step.id, out, seconds, later) if self.reports else None

    def _repeat(self, step: Step, mark: float, later: list[dict[int, Sampled]]) -> float:
        """Runs 1 .. repeat - 1 of `step` into `later`: in one compiled call where the rows are greedy and the rank
        takes it (runtime/greedy_run.py; the clock then counts each run as an equal share of it), else one by one.
        Returns the clock's mark."""
        decodes, runs = list(step.decodes), step.repeat - 1
        if runs <= 0:
            return mark
        mark = self._tick(mark)  # run 0
        greedy = self.greedy is not None and all(d.slot in self.sampled for d in decodes)
        tokens = self.greedy.tokens(decodes, [self.sampled[d.slot] for d in decodes], 1, runs) if greedy else None
        if tokens is None:
            for i in range(1, step.repeat):
                mark = mark if i == 1 else self._tick(mark)
                later.append({})
                self._run_items(self._decode_items(_moved(decodes, i)), later[-1])
            return mark
        return self._spread(decodes, tokens, mark, None, later)

    def _compiled(self, step: Step) -> list[list[int]] | None:
        """Every run's tokens (repeat, rows) of a step of greedy decode rows only, from one compiled call; None where
        the step has prompts or slots to start, or the rank or the rows do not take the call."""
        if self.greedy is None or step.starts or step.prefills or step.copies or not step.decodes:
            return None
        decodes = list(step.decodes)
        return self.greedy.tokens(decodes, [self.fed_token(d) for d in decodes], 0, step.repeat)

    def _spread(self, decodes: list[Decode], tokens: list[list[int]], mark: float, out: dict[int, Sampled] | None,
                later: list[dict[int, Sampled]]) -> float:
        """A compiled call's tokens (runs, rows) as the Python runs would have left them: the first run into `out`
        (when given) and the others into `later`, each slot's last sample kept; the clock counts each run as an equal
        share of the call (the last one by the caller's final tick). Returns the clock's mark."""
        now = time.perf_counter()
        share = (now - mark) / len(tokens)
        for i, row in enumerate(tokens):
            got = {d.slot: Sampled(token=t) for d, t in zip(decodes, row)}
            if i == 0 and out is not None:
                out.update(got)
            else:
                later.append(got)
            if i < len(tokens) - 1:  # the last run's share: the caller's final tick, which also counts from `now`
                self.clock.add(share)
        for d, t in zip(decodes, tokens[-1]):
            self.sampled[d.slot] = t
        return now - share

    def _tick(self, mark: float) -> float:
        """Count the run since `mark` in the clock; returns now."""
        now = time.perf_counter()
        self.clock.add(now - mark)
        return now

    def _run_items(self, items: list, out: dict[int, Sampled]) -> None:
        """Run forward passes in order; the last stage samples each into `out`."""
        for item in items:
            logits = self._replayed(item)
            if logits is None and self.greedy is not None and item.work and isinstance(item.work[0], Decode):
                logits = self.greedy.logits(item.work, item.tokens[:, 0].tolist())  # the compiled path, or None
            if logits is None:
                logits = self._forward(item)
            if logits is not None:
                out.update(self._sample(item, logits))

    def _items(self, step: Step) -> list[_Item]:
        if self.rank.kernels.shared_prefill:
            groups = prefill_groups(step.prefills, self.cache.max_len)
        else:  # a GPU's products pick kernels by shape: one chunk a pass keeps a chunk's numbers its own
            groups = [[p] for p in step.prefills]
        return [self._prefill_item(group) for group in groups] + self._decode_items(list(step.decodes))

    def _decode_items(self, decodes: list[Decode]) -> list[_Item]:
        """Decode rows as micro-batches (one per stage at most)."""
        items = []
        groups = min(len(decodes), self.micro_batches or self.rank.spec.pp)
        for a, b in (micro_batch_rows(len(decodes), groups) if decodes else []):
            part = decodes[a:b]
            pos = [d.position for d in part]
            items.append(_Item(torch.tensor([[self.fed_token(d)] for d in part]), torch.tensor(pos)[:, None],
                               decode_mask(pos, self.window), self.cache.decode([d.slot for d in part], pos), part,
                               False))
        return items

    def _replayed(self, item: _Item) -> torch.Tensor | None:
        """A decode item's logits (b, 1, vocab) from a CUDA graph replay (runtime/slot_graphs.py), or None: not a
        decode item, no graphs on this rank, or capturing failed (the item then runs eagerly)."""
        if self.graphs is None or not item.work or not isinstance(item.work[0], Decode):
            return None
        return self.graphs.logits([d.slot for d in item.work], item.positions[:, 0].tolist(),
                                  item.tokens[:, 0].tolist())

    def fed_token(self, d: Decode) -> int:
        """The token a decode row feeds: its own, or the slot's last sample (held here for pipelined steps)."""
        if d.token is not None:
            return d.token
        if d.slot not in self.sampled:
            raise RuntimeError(f"step asks for slot {d.slot}'s last sampled token, and this rank sampled none for it "
                               f"(only ranks of the last stage sample; a plan with pipeline stages runs steps unpipelined)")
        return self.sampled[d.slot]

    def _prefill_item(self, group: list[Prefill]) -> _Item:
        """One forward pass for prefill chunks of one or more slots (right-padded to the longest)."""
        width = max(len(p.tokens) for p in group)
        starts = [p.start for p in group]
        tokens = torch.tensor([list(p.tokens) + [0] * (width - len(p.tokens)) for p in group])  # (b, s)
        positions = torch.tensor(starts)[:, None] + torch.arange(width)[None, :]  # (b, s)
        if len(group) == 1:
            run = self.cache.prefill(group[0].slot, starts[0], width)
        else:
            run = self.cache.prefill_rows([p.slot for p in group], starts, width)
        last = torch.tensor([len(p.tokens) - 1 for p in group])  # (b,)
        return _Item(tokens, positions, prefill_mask(starts, width, self.window), run, group,
                     group[0].prompt_logprobs, None if len(group) == 1 else last)

    def _forward(self, item: _Item) -> torch.Tensor | None:
        """This stage's part of one item: logits (b, s or 1, vocab) on the last stage, else None."""
        ctx, dev, model = self.ctx, self.rank.device, self.rank.module
        b, s = item.tokens.shape
        if self.first:
            x = item.tokens
        else:
            x = ctx.recv((b, s, self.rank.args.dim), self.rank.dtype, ctx.pipe.prev)  # (b, s, dim)
        positions, mask, last = item.positions, item.mask, item.last
        if dev.type != "cpu":
            x, positions, mask = (t.to(dev, non_blocking=True) for t in (x, positions, mask))
            last = last.to(dev, non_blocking=True) if last is not None else None
        out = model(x, positions, mask, item.run, last_only=not item.full_logits, last_index=last)
        if not self.last:
            ctx.send(out, ctx.pipe.next)
            return None
        return out

    def _sample(self, item: _Item, logits: torch.Tensor) -> dict[int, Sampled]:
        """Each row's next token (with its logprobs when asked), and a prefill's prompt logprobs."""
        out = {}
        last = logits[:, -1]  # (b, vocab)
        tokens = self._tokens(item.work, last)
        for j, w in enumerate(item.work):
            got = Sampled()
            if isinstance(w, Prefill) and w.prompt_logprobs:
                got.prompt_logprobs = _prompt_logprobs(logits[0], w)
            if j in tokens:
                got.token = tokens[j]
                self.sampled[w.slot] = got.token
                if w.logprobs is not None:
                    got.logprob = _logprob(last[j], got.token, w.logprobs)
            out[w.slot] = got
        return out

    def _tokens(self, work: list, last: torch.Tensor) -> dict[int, int]:
        """The next token of each row j of `work` that samples, from its logits last[j] (b, vocab): the greedy rows
        from one argmax over all rows, the others through `pick` once for each set of rows with the same temperature,
        top-p and top-k, each row drawing from its slot's generator. A row's draw is its own alone (torch's softmax,
        cumulative sums and stable sort work row by row; tests/unit/test_sampling.py). 16 rows of the bundled model's
        49 152-token vocabulary in a float32 decode step: one by one 1.5-1.7 ms, together 1.15-1.2 ms, together with
        the compiled draw 0.8 ms (bench/RESULTS.md, serving notes of 2026-11-28)."""
        rows = [j for j, w in enumerate(work) if isinstance(w, Decode) or w.sample]
        tokens: dict[int, int] = {}
        if any(work[j].params.temperature == 0 for j in rows):
            greedy = self._argmax(last.float()).tolist()  # a row's argmax is its own alone
            tokens.update((j, greedy[j]) for j in rows if work[j].params.temperature == 0)
        groups: dict[tuple, list[int]] = {}
        for j in rows:
            p = work[j].params
            if p.temperature != 0:
                groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(j)
        for js in groups.values():
            if js == list(range(len(last))):
                part = last  # every row, in order: no copy
            else:
                part = last[js[0]:js[0] + 1] if len(js) == 1 else last[torch.tensor(js)]  # (rows, vocab)
            gens = [self.generators[work[j].slot] for j in js]
            drawn = pick(part, work[js[0]].params, gens, self._draw_ops).tolist()
            tokens.update(zip(js, drawn))
        return tokens


def _moved(decodes, i: int) -> list[Decode]:
    """Decode run i of a repeated step: each row feeds the slot's last sample at its i-th next position."""
    return [Decode(d.slot, None, d.position + i, d.params, d.logprobs) for d in decodes]


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (b, vocab) -> (b,)."""
    return logits.argmax(dim=-1)


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
