"""Prefill and decode on one rank: left-padded batches, attention masks, rotary positions, KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from shardlm.runtime.kvcache import KVCache
from shardlm.runtime.sampling import SamplingParams, sample


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


@dataclass
class GenerationStats:
    """Timings of one generate call on this rank."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    decode_tokens: int = 0
    extra: dict = field(default_factory=dict)


@torch.inference_mode()
def generate(model: nn.Module, batch: Batch, max_new_tokens: int, params: SamplingParams,
             eos_ids: tuple[int, ...], kv_heads: int, on_token: Callable[[torch.Tensor], None] | None = None,
             stats: GenerationStats | None = None) -> list[list[int]]:
    """Generate up to `max_new_tokens` per prompt; returns the new token ids (eos included, then stop).

    `on_token(tokens (b,))` is called after every step (for streaming). Finished rows keep
    running with their last token until every row is done, and their extra tokens are dropped.
    """
    stats = stats if stats is not None else GenerationStats()
    args = model.args
    b, s = batch.tokens.shape
    dtype = next(model.parameters()).dtype
    cache = KVCache(list(range(args.n_layers)), b, kv_heads, s + max_new_tokens, args.head_dim, dtype)
    gen = torch.Generator().manual_seed(params.seed)
    valid, positions = batch.valid, positions_for(batch.valid)
    t0 = time.perf_counter()
    logits = model(batch.tokens, positions, attention_mask(valid, 0, s, args.sliding_window), cache, last_only=True)
    cache.advance(s)
    stats.prefill_s += time.perf_counter() - t0
    stats.prompt_tokens += int(valid.sum())
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    eos = torch.tensor(eos_ids or (-1,), dtype=torch.long)
    t0 = time.perf_counter()
    for step in range(max_new_tokens):
        token = sample(logits[:, -1], params, gen)  # (b,)
        for i in (~done).nonzero().flatten().tolist():
            out[i].append(int(token[i]))
        if on_token is not None:
            on_token(torch.where(done, torch.full_like(token, -1), token))
        done = done | torch.isin(token, eos)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        positions = positions[:, -1:] + 1  # (b, 1)
        valid = torch.cat([valid, torch.ones(b, 1, dtype=torch.bool)], dim=1)  # (b, t)
        mask = attention_mask(valid, cache.offset, 1, args.sliding_window)
        logits = model(token[:, None], positions, mask, cache, last_only=True)
        cache.advance(1)
        stats.decode_tokens += b
    stats.decode_s += time.perf_counter() - t0
    return out
