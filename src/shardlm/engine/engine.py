"""LocalEngine: the Engine with a batch call, for `shardlm generate`, the benchmarks and scripts.

`generate` submits every prompt as its own request and waits for all of them: the same scheduler,
slots and steps a server runs, so a prompt's tokens are the same whichever way it arrives.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable

from shardlm.engine.ranks import RankFailure
from shardlm.engine.requests import GenerationParams, Request, TokenEvent
from shardlm.engine.service import Engine
from shardlm.parallel.stages import auto_micro_batches
from shardlm.runtime.protocol import SamplingParams

SEED_STRIDE = 1_000_003
"""Prompt i of a batch samples from seed * SEED_STRIDE + i (each prompt its own stream, as before)."""

CPU_DECODE_RUN = 8
"""Decode tokens a row per step message for `generate` on CPU ranks (Engine's `decode_run`): one message each way
per 8 tokens rather than per token leaves the ranks' cores to them. bench/decode_runs.py (bundled model, tp 1,
batch 1, 2 cores, 5 rounds): runs of 8 decoded 1.15x as fast as runs of 1 in int4, 1.11x in int8, 1.03x in float32;
runs of 16 no faster than 8 (bench/RESULTS.md)."""


@dataclass
class GenerateResult:
    """What one batch produced, plus per-rank stats."""

    token_ids: list[list[int]]
    ranks: list[dict]
    prefill_s: float
    """From submission to the last prompt's first token."""
    decode_s: float
    """From then to the last token."""
    prompt_tokens: int
    decode_tokens: int
    """Tokens generated after each prompt's first."""
    finish_reasons: list[str]


class LocalEngine(Engine):
    """An Engine (ranks on this machine) with `generate` for a batch of prompts; its steps are pipelined (see
    Engine.pipelined) unless `pipelined=False`, and on CPU ranks a step decodes up to CPU_DECODE_RUN tokens a row
    unless `decode_run` says otherwise (GPU ranks: 1, where run-ahead steps keep tokens on the device instead,
    runtime/ahead.py)."""

    def __init__(self, plan, *args, pipelined: bool = True, decode_run: int | None = None, **kwargs):
        if decode_run is None:
            decode_run = CPU_DECODE_RUN if plan.device == "cpu" else 1
        super().__init__(plan, *args, pipelined=pipelined, decode_run=decode_run, **kwargs)

    @property
    def world(self) -> int:
        """Rank processes."""
        return self.group.world

    @property
    def ready(self) -> list[dict]:
        """Each rank's report once loaded (device, memory, kernels ...)."""
        return self.group.ready

    @property
    def load_s(self) -> float:
        """Seconds from spawning the ranks to all of them loaded."""
        return self.group.load_s

    def micro_batches(self, batch: int) -> int:
        """Decode micro-batches for `batch` rows: the plan's, else one per stage capped by the batch."""
        pp = self.plan.layout.pp
        return 1 if pp == 1 else min(batch, self.plan.micro_batches or auto_micro_batches(batch, pp))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams, pad_id: int = 0,
                 on_event: Callable[[int, TokenEvent], None] | None = None, ignore_eos: bool = False) -> GenerateResult:
        """Generate up to `max_new_tokens` for every prompt (token ids); `on_event(i, event)` sees prompt i's
        tokens as they come. RankFailure when a rank fails, dies or hangs."""
        t0 = time.monotonic()
        sink: queue.Queue = queue.Queue()
        reqs = []
        for i, ids in enumerate(prompts):
            params = GenerationParams(max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
                                      sampling.seed * SEED_STRIDE + i, ignore_eos=ignore_eos)
            reqs.append(self.submit(ids, params, sink=sink))
        row = {r.id: i for i, r in enumerate(reqs)}
        left = len(reqs)
        while left:
            req, event = sink.get()
            if event.finish_reason == "error":
                raise self.failure or RankFailure(event.error or "the engine failed")
            if on_event is not None:
                on_event(row[req.id], event)
            left -= event.finish_reason is not None
        return self._result(reqs, t0)

    def _result(self, reqs: list[Request], t0: float) -> GenerateResult:
        first = max(r.first_token_at or t0 for r in reqs)
        last = max(r.last_token_at or first for r in reqs)
        return GenerateResult([r.output_ids for r in reqs], self.rank_stats(), first - t0, last - first,
                              sum(len(r.prompt_ids) for r in reqs), sum(max(0, len(r.output_ids) - 1) for r in reqs),
                              [r.finish_reason for r in reqs])


__all__ = ["GenerateResult", "LocalEngine", "RankFailure"]
