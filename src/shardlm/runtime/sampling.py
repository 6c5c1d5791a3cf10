"""Token sampling: greedy, temperature, top-k and top-p, deterministic for a given seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy."""

    temperature: float = 0.0
    """Softmax temperature; 0 picks the most likely token."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability adds up to at least top_p (0 < top_p <= 1)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    seed: int = 0
    """Seed of the sampling generators (every rank uses it, so every rank draws the same token)."""

    def validate(self) -> None:
        """Raise ValueError naming the bad value and the accepted range."""
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0 = no limit), got {self.top_k}")


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
