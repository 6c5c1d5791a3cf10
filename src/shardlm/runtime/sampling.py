"""Token sampling: greedy, temperature, top-k and top-p, deterministic for a given seed."""

from __future__ import annotations

import torch

from shardlm.runtime.protocol import SamplingParams


def row_generators(seed: int, rows: int) -> list[torch.Generator]:
    """One generator per sequence of a batch, seeded from `seed` and the row number.

    Each sequence draws from its own stream, so its tokens do not depend on how the batch is cut
    into micro-batches or on which stage samples it.
    """
    return [torch.Generator().manual_seed(seed * 1_000_003 + row) for row in range(rows)]


def sample(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """Pick one token per row of logits (b, vocab) -> (b,); row i draws from generators[i]."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked before it already reach top_p
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)  # (b, vocab)
    return torch.cat([torch.multinomial(p[None], 1, generator=g)[0] for p, g in zip(probs, generators)])
