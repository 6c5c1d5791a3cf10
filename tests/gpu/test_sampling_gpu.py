"""Sampling a GPU rank's logits (runtime/serve_step.py `SlotRunner._tokens`): rows with equal settings drawn in one
call from CUDA logits give each row the token it draws alone, and the tokens the same logits give on the CPU.

Skipped where torch sees no CUDA device (CI); tests/unit/test_sampling.py holds the same on the CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardlm.runtime.protocol import SamplingParams
from shardlm.runtime.serve_step import SlotRunner, _torch_argmax
from shardlm.runtime.work import Decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")

KINDS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=5),
         SamplingParams(temperature=1.0, top_p=0.5)]


def _tokens(work, last) -> dict[int, int]:
    """SlotRunner._tokens of `work` with fresh per-slot generators (the torch draw: no compiled kernels here)."""
    runner = SimpleNamespace(_argmax=_torch_argmax, _draw_ops=None,
                             generators={w.slot: torch.Generator().manual_seed(50 + w.slot) for w in work})
    return SlotRunner._tokens(runner, work, last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampled_rows_from_cuda_logits_draw_their_tokens_alone_and_as_on_the_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    work = [Decode(j, 3, 5, KINDS[j % len(KINDS)]) for j in range(12)]
    last = (torch.randn(12, 3000, generator=g) * 3).to(dtype)
    on_gpu = _tokens(work, last.cuda())
    assert on_gpu == _tokens(work, last)
    for j in range(12):
        assert _tokens([work[j]], last[j:j + 1].cuda()) == {0: on_gpu[j]}, j
