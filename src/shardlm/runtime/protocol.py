"""What the driver and its rank processes say to each other: plain picklable records that import no torch.

The driver (engine/) builds these and never imports torch itself; only the ranks (runtime/) do. That
keeps a command's start-up to one torch import on the critical path (the ranks', in parallel)
instead of two in a row. Both sides import this module, so it sits on the rank side's floor.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.models.source import ModelSource
from shardlm.plan.plan import RankSpec
from shardlm.settings import Settings


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


@dataclass(frozen=True)
class RankLaunch:
    """Everything a rank process needs to start (picklable): its part of the Plan and how to reach its peers."""

    spec: RankSpec
    """What this rank builds and runs (plan.rank_spec(rank))."""
    source: ModelSource
    """The checkpoint and the model's shape."""
    port: int
    """Port of rank 0's rendezvous store on 127.0.0.1."""
    threads: int
    """Torch threads for this rank."""
    shm_bytes: int
    """Slot size of the shared-memory transport for same-host collectives; 0 uses gloo only."""
    timeout_s: float
    """Longest wait for a peer in a collective."""
    settings: Settings
    """The driver's settings (kernels, cache folder, log level ...)."""


@dataclass(frozen=True)
class Request:
    """One generate call: a batch of tokenized prompts."""

    prompts: list[list[int]]
    max_new_tokens: int
    sampling: SamplingParams
    pad_id: int = 0
    ignore_eos: bool = False
    micro_batches: int = 1
    """Micro-batches in flight through the pipeline stages (1 without pipeline parallelism)."""
