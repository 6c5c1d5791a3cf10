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


def _logits(rows: int, vocab: int, seed: int, ties: bool) -> torch.Tensor:
    """Random logits (rows, vocab); with `ties`, rounded to quarters so that many tie, -inf sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    if ties:
        x = (x * 4).round() / 4
        x[torch.rand(rows, vocab, generator=g) < 0.05] = float("-inf")
    return x


def _ops():
    from shardlm import kernels
    from shardlm.settings import Settings

    ops = kernels.extension(Settings().kernel_dir)
    assert ops is not None, "the compiled kernels should build on this machine"
    return ops


def test_every_row_samples_alone_what_it_samples_among_others():
    # the serving rank samples each set of rows with equal parameters in one call (runtime/serve_step.py `_tokens`)
    cases = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=40),
             SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, top_k=100, top_p=0.95)]
    for vocab in (7, 1000, 4099, 49152):
        for ties in (False, True):
            logits = _logits(16, vocab, vocab, ties)
            for i, params in enumerate(cases):
                seeds = [100 * i + j for j in range(16)]
                together = sample(logits, params, [torch.Generator().manual_seed(s) for s in seeds]).tolist()
                alone = [int(sample(logits[j:j + 1], params, [torch.Generator().manual_seed(seeds[j])])[0])
                         for j in range(16)]
                assert together == alone, (vocab, ties, params)


def test_a_serving_step_samples_each_row_as_it_would_alone():
    from types import SimpleNamespace

    from shardlm.runtime.serve_step import SlotRunner, _torch_argmax
    from shardlm.runtime.work import Decode, Prefill

    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=5),
             SamplingParams(temperature=1.0, top_p=0.5)]
    work = []
    for j in range(12):
        params = kinds[j % len(kinds)]
        work.append(Prefill(j, (1, 2), 0, j % 5 != 4, params) if j % 3 == 0 else Decode(j, 3, 5, params))
    last = _logits(12, 3000, 5, True)
    runner = SimpleNamespace(_argmax=_torch_argmax, generators={}, _draw_ops=_ops())

    def fresh() -> None:
        runner.generators = {j: torch.Generator().manual_seed(1000 + j) for j in range(12)}

    fresh()
    together = SlotRunner._tokens(runner, work, last)
    samples = [j for j, w in enumerate(work) if isinstance(w, Decode) or w.sample]
    assert sorted(together) == samples
    for j in samples:
        fresh()
        assert SlotRunner._tokens(runner, [work[j]], last[j:j + 1]) == {0: together[j]}, j


def test_the_compiled_draw_is_the_torch_draw():
    ops = _ops()
    for vocab in (1, 2, 7, 1000, 49152):
        for ties in (False, True):
            probs = _logits(9, vocab, vocab + 1, ties).softmax(dim=-1)  # zeros where -inf
            probs[3] = 0.0
            probs[3, vocab // 2] = 1.0  # one certain token
            for seed in range(3):
                gens = row_generators(seed, 9)
                alone = draw(probs, gens)
                assert torch.equal(draw(probs, row_generators(seed, 9), ops), alone), (vocab, ties, seed)


def test_the_compiled_draw_keeps_the_edges(monkeypatch):
    """Uniforms at 0, at 1 and on a cumulative sum exactly; rows without a positive or a finite total."""
    ops = _ops()
    probs = torch.tensor([[0.25, 0.25, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5, 0.0],
                          [0.2, 0.2, 0.2, 0.2, 0.2]])
    for value in (0.0, 0.25, 0.5, 0.75, 1.0, 1.0 - 2**-53):
        monkeypatch.setattr(torch, "rand", lambda *a, value=value, **k: torch.tensor([value], dtype=torch.float64))
        assert torch.equal(draw(probs, row_generators(0, 4), ops), draw(probs, row_generators(0, 4))), value
        assert torch.equal(ops.draw_rows(probs, torch.full((4,), value, dtype=torch.float64)),
                           draw(probs, row_generators(0, 4))), value
    monkeypatch.undo()
    odd = torch.tensor([[0.5, float("nan"), 0.5], [0.5, float("inf"), 0.5], [0.2, 0.3, 0.5]])
    u = torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64)
    assert ops.draw_rows(odd, u).tolist() == [-1, -1, 1]
    assert torch.equal(draw(odd, row_generators(4, 3), ops), draw(odd, row_generators(4, 3)))


def test_sampling_with_the_compiled_draw_gives_the_same_tokens():
    ops = _ops()
    cases = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=40),
             SamplingParams(temperature=1.3, top_p=0.8)]
    logits = _logits(16, 49152, 3, False)
    for params in cases:
        compiled = sample(logits, params, row_generators(9, 16), ops)
        assert torch.equal(compiled, sample(logits, params, row_generators(9, 16)))
