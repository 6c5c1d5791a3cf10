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


def sample(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator], ops=None) -> torch.Tensor:
    """Pick one token per row of logits (b, vocab) -> (b,); row i draws from generators[i].

    A row draws one uniform number u from its generator and takes the first token whose cumulative
    probability exceeds u (inverse-CDF sampling, cumulative sums in float64): the distribution
    torch.multinomial samples, at one random number a row where multinomial draws one per vocabulary
    entry (16 rows of a 49 152-token vocabulary: 24 ms against 5, measured; a serving step at
    concurrency 16 spent a tenth of its time there). `ops`: the compiled kernels, whose draw_rows draws the same
    tokens in one pass over the probabilities (csrc/draw.h)."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if params.temperature != 1.0:  # x / 1.0 is x: one pass over the rows saved
        logits = logits / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        # stable: tied logits keep their vocabulary order, so a row keeps the same tokens alone and among others
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked before it already reach top_p
        drop = probs.cumsum(dim=-1) - probs >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)  # (b, vocab)
    return draw(probs, generators, ops)


def draw(probs: torch.Tensor, generators: list[torch.Generator], ops=None) -> torch.Tensor:
    """One index per row of probs (b, vocab) -> (b,), row i with its probabilities and generators[i] (see
    `sample`). Never an index of probability 0. With `ops` (the compiled kernels), float32 rows of finite total are
    drawn by its draw_rows, which gives these ops' indices bit for bit (tests/unit/test_sampling.py)."""
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])  # (b,)
    if ops is not None and probs.dtype == torch.float32 and probs.device.type == "cpu":
        idx = ops.draw_rows(probs, u)
        if bool((idx >= 0).all()):
            return idx
    cdf = probs.double().cumsum(dim=-1)  # (b, vocab)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # (b,)
    idx = idx.clamp_(max=probs.shape[-1] - 1)
    bad = probs.gather(-1, idx[:, None])[:, 0] <= 0
    if not bool(bad.any()):
        return idx
    # u * total rounded up to the total: take the row's last token of positive probability
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)  # (b,)
    return torch.where(bad, last, idx)
