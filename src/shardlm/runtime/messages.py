"""What the driver sends to its rank processes: plain picklable records that import no torch.

The driver (CLI, server) builds these and never imports torch itself; only the ranks do. That
keeps a command's start-up to one torch import on the critical path (the ranks', in parallel)
instead of two in a row.
"""

from __future__ import annotations

from dataclasses import dataclass


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
class WorkerConfig:
    """Everything a rank needs to start (picklable)."""

    rank: int
    world: int
    port: int
    model_dir: str
    family: str
    args: dict
    dtype: str
    threads: int
    shm_bytes: int
    """Slot size of the shared-memory transport for same-host collectives; 0 uses gloo only."""
    timeout_s: float
    tp: int = 0
    """Ranks per pipeline stage (0: all ranks form one tensor-parallel group)."""
    stage_layers: tuple = ()
    """[start, stop) decoder layers of each pipeline stage; empty: one stage with every layer."""
    quantization: str | None = None
    """Weight-only quantization applied at load (None, "int8", "int4")."""
    memory_budget: int | None = None
    """Bytes of weights and read buffers this rank may hold; the layers beyond it stream from disk."""
    offload_dir: str | None = None
    """Folder for the streamed layers' scratch file (default $SHARDLM_HOME/offload)."""
    prefetch: bool = True
    """Read the next streamed layer while the current one computes."""
    stream_layers: tuple = ()
    """Per stage, how many of its last layers stream from disk (a manifest's offload.layers); overrides the budget."""
    device: str = "cpu"
    """"cpu", or "cuda": rank r runs on GPU r mod the GPUs it sees (NCCL when each rank has its own)."""

    @property
    def pp(self) -> int:
        """Pipeline stages."""
        return max(1, len(self.stage_layers))


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
