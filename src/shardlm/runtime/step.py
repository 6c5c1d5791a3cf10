"""Prefill and decode on one rank: left-padded batches, attention masks, rotary positions, KV cache.

The bookkeeping (tokens, masks, positions, sampling) stays in host memory on every device; a GPU
rank gets each step's inputs copied in and hands back only the sampled tokens (greedy: the argmax
runs on the GPU) or the last position's logits (sampling draws on the host, so a seed gives the
same tokens on CPU and GPU ranks). Greedy decode through a CUDA graph that advances its own inputs
runs a few steps ahead of the host (runtime/cuda_graph.py `run_ahead`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from shardlm.runtime.kvcache import KVCache
from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.rank_model import RankModel
from shardlm.runtime.sampling import row_generators, sample


@dataclass
class Batch:
    """Prompts left-padded to one length: tokens and valid are (b, s)."""

    tokens: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def from_lists(cls, prompts: list[list[int]], pad_id: int = 0) -> "Batch":
        """Left-pad token-id lists so that the last prompt token of every row is in the last column."""
        s = max(len(p) for p in prompts)
        tokens = torch.full((len(prompts), s), pad_id, dtype=torch.long)
        valid = torch.zeros((len(prompts), s), dtype=torch.bool)
        for i, p in enumerate(prompts):
            tokens[i, s - len(p):] = torch.tensor(p, dtype=torch.long)
            valid[i, s - len(p):] = True
        return cls(tokens, valid)


def positions_for(valid: torch.Tensor) -> torch.Tensor:
    """Rotary positions (b, s): 0, 1, 2... counted over valid tokens only (pads get 0)."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def attention_mask(valid: torch.Tensor, start: int, s: int, window: int | None) -> torch.Tensor:
    """Boolean mask (b, 1, s, t) for queries at slots [start, start+s) over keys at slots [0, t).

    A query sees earlier valid keys (and, with a sliding window, only the last `window` of them).
    A query always sees its own slot, so padded rows never have every key masked (which would
    make SDPA return NaN and poison the cache).
    """
    t = start + s
    q_slot = torch.arange(start, t)[:, None]  # (s, 1)
    k_slot = torch.arange(t)[None, :]  # (1, t)
    allowed = k_slot <= q_slot
    if window is not None:
        allowed = allowed & (k_slot > q_slot - window)
    mask = allowed[None] & valid[:, None, :t]  # (b, s, t)
    mask = mask | (k_slot == q_slot)[None]
    return mask[:, None]  # (b, 1, s, t)


def model_device(model: nn.Module) -> torch.device:
    """The device a model runs on: that of its first non-meta parameter, else of its buffers (a
    pipeline stage whose every layer streams in holds only meta placeholders between uses)."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def pick(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator], ops=None) -> torch.Tensor:
    """`sample` for logits (b, vocab) on any device -> host tokens (b,). Greedy takes the argmax where
    the logits are; sampling draws on the host with the rows' generators (and `ops`, the compiled kernels, if
    given: see `sample`)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1).cpu()
    return sample(logits.float().cpu(), params, generators, ops)


@dataclass
class GenerationStats:
    """Timings of one generate call on this rank."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    decode_tokens: int = 0
    extra: dict = field(default_factory=dict)


class Rows:
    """Rows of a batch that move through the model together: their mask state, positions and KV cache.

    A whole batch in the plain path; one micro-batch on one stage in the pipelined path.
    """

    def __init__(self, batch: Batch, cache: KVCache, window: int | None, device: torch.device | str = "cpu"):
        self.valid = batch.valid  # (b, t): which cache slots hold real tokens
        self.positions = positions_for(batch.valid)  # (b, s) positions of the tokens about to run
        self.window = window
        self.device = torch.device(device)
        self.cache = cache
        """At least prompt + new tokens long (a CUDA graph decoder's own, or a new one)."""

    @classmethod
    def for_model(cls, rank: RankModel, batch: Batch, max_new_tokens: int) -> "Rows":
        """Rows of `batch` on `rank` with a new cache for the prompt plus `max_new_tokens`."""
        b, s = batch.tokens.shape
        return cls(batch, rank.new_cache(b, s + max_new_tokens), rank.args.sliding_window, rank.device)

    def prefill_mask(self) -> torch.Tensor:
        """Mask (b, 1, s, s) of the prompt pass."""
        return attention_mask(self.valid, 0, self.valid.shape[1], self.window)

    def next_token(self) -> torch.Tensor:
        """Advance to one new token per row; returns its mask (b, 1, 1, t)."""
        b = self.valid.shape[0]
        self.positions = self.positions[:, -1:] + 1  # (b, 1)
        self.valid = torch.cat([self.valid, torch.ones(b, 1, dtype=torch.bool)], dim=1)  # (b, t)
        return attention_mask(self.valid, self.cache.offset, 1, self.window)

    def forward(self, model: nn.Module, inputs: torch.Tensor, mask: torch.Tensor, last_only: bool = True) -> torch.Tensor:
        """Run `model` on `inputs` at the current positions and fill the cache (inputs, positions and
        mask are copied to the model's device first)."""
        if self.device.type != "cpu":
            inputs, positions, mask = (t.to(self.device, non_blocking=True) for t in (inputs, self.positions, mask))
        else:
            positions = self.positions
        out = model(inputs, positions, mask, self.cache, last_only=last_only)
        self.cache.advance(inputs.shape[1])
        return out


class Outputs:
    """Generated tokens per sequence, with end-of-sequence and length limits applied."""

    def __init__(self, batch: int, eos_ids: tuple[int, ...], max_new_tokens: int):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.done = torch.zeros(batch, dtype=torch.bool)
        self.eos = torch.tensor(eos_ids or (-1,), dtype=torch.long)
        self.max_new_tokens = max_new_tokens

    def record(self, start: int, token: torch.Tensor) -> bool:
        """Append `token` (n,) to rows [start, start+n) that are still running; True when all n are finished."""
        stop = start + token.shape[0]
        done = self.done[start:stop]
        for i in (~done).nonzero().flatten().tolist():
            self.tokens[start + i].append(int(token[i]))
        self.done[start:stop] = done | torch.isin(token, self.eos) | \
            torch.tensor([len(self.tokens[r]) >= self.max_new_tokens for r in range(start, stop)])
        return bool(self.done[start:stop].all())

    def stream_view(self, start: int, token: torch.Tensor, was_done: torch.Tensor) -> list[int]:
        """The whole batch's row list for streaming: `token` at rows [start, ...), -1 elsewhere and for finished rows."""
        out = [-1] * len(self.tokens)
        for i, t in enumerate(token.tolist()):
            if not was_done[i]:
                out[start + i] = t
        return out


@torch.inference_mode()
def generate(rank: RankModel, batch: Batch, max_new_tokens: int, params: SamplingParams,
             eos_ids: tuple[int, ...], on_token: Callable[[list[int]], None] | None = None,
             stats: GenerationStats | None = None) -> list[list[int]]:
    """Generate up to `max_new_tokens` per prompt; returns the new token ids (eos included, then stop).

    `on_token(tokens)` is called after every step (for streaming) with one id per row, -1 for rows
    already finished. Finished rows keep running with their last token until every row is done,
    and their extra tokens are dropped.
    """
    stats = stats if stats is not None else GenerationStats()
    model, args, device = rank.module, rank.args, rank.device
    b, s = batch.tokens.shape
    # decode steps as CUDA graph replays on one GPU: the graph's decoder owns the cache
    graph = rank.graphs.decoder(rank.layer_ids, b, rank.kv_heads, s + max_new_tokens, args.head_dim, rank.dtype,
                                device) if rank.graphs is not None else None
    rows = Rows(batch, graph.cache, args.sliding_window, device) if graph is not None else \
        Rows.for_model(rank, batch, max_new_tokens)
    if graph is not None:
        graph.bind(rows)
    gens = row_generators(params.seed, b)
    outputs = Outputs(b, eos_ids, max_new_tokens)
    t0 = time.perf_counter()
    logits = rows.forward(model, batch.tokens, rows.prefill_mask())
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the prefill's kernels are queued, not done, when forward returns
    stats.prefill_s += time.perf_counter() - t0
    stats.prompt_tokens += int(batch.valid.sum())
    t0 = time.perf_counter()
    token = pick(logits[:, -1], params, gens)  # (b,)
    # greedy on a graph that advances its own inputs: the GPU runs a few steps ahead of the host
    ahead = graph.run_ahead(token, max_new_tokens - 1) if graph is not None and graph.ahead and \
        params.temperature == 0 else None
    while True:
        was_done = outputs.done.clone()
        finished = outputs.record(0, token)
        if on_token is not None:
            on_token(outputs.stream_view(0, token, was_done))
        if finished:
            break
        if ahead is not None:
            token = next(ahead)
        else:
            logits, mask = graph.step(token) if graph is not None and not graph.failed else (None, rows.next_token())
            if logits is None:
                logits = rows.forward(model, token[:, None], mask)
            token = pick(logits[:, -1], params, gens)  # (b,)
        stats.decode_tokens += b
    if ahead is not None:
        ahead.close()
    stats.decode_s += time.perf_counter() - t0
    return outputs.tokens
