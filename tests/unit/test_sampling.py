"""Token sampling: one uniform number a row (inverse CDF), the multinomial's distribution, never a token of
probability 0, and a row's draw independent of the rows beside it."""

from __future__ import annotations

import torch

from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.sampling import draw, row_generators, sample


def test_draws_follow_the_probabilities():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]])
    gens = row_generators(7, 1)
    n = 20_000
    counts = torch.bincount(torch.cat([draw(probs, gens) for _ in range(n)]), minlength=5).double()
    assert counts[1] == 0 and counts[4] == 0
    expected = probs[0].double() * n
    seen = counts[[0, 2, 3]]
    # chi-square with 2 degrees of freedom: 13.8 is the 0.1 % tail
    chi2 = float(((seen - expected[[0, 2, 3]]) ** 2 / expected[[0, 2, 3]]).sum())
    assert chi2 < 13.8, (counts, chi2)


def test_a_uniform_at_the_top_never_picks_a_token_of_probability_zero(monkeypatch):
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor([1.0], dtype=torch.float64))
    assert draw(probs, row_generators(0, 2)).tolist() == [1, 0]


def test_a_row_draws_the_same_token_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1000, generator=g)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    together = sample(logits, params, row_generators(11, 6))
    alone = [int(sample(logits[j:j + 1], params, [row_generators(11, 6)[j]])[0]) for j in range(6)]
    assert together.tolist() == alone
    again = sample(logits, params, row_generators(11, 6))
    assert torch.equal(together, again)
    top50 = torch.topk(logits, 50, dim=-1).indices
    assert all(int(t) in top50[j].tolist() for j, t in enumerate(together))
