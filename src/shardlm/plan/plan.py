"""The Plan: what the planner decided and what it predicts. The manifest is its YAML form.

The Plan is the single source of truth downstream: the sharder, the loader, the runtime and the
monitor read it; none re-derives a layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.plan.layout import ParallelLayout

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "int4")
OFFLOAD_TIERS = ("none", "cpu", "disk")
OBJECTIVES = ("latency", "throughput")
IMBALANCE_LIMIT = 0.15
"""Largest allowed stage-time imbalance (slowest stage / mean stage time - 1) before validation fails."""


@dataclass(frozen=True)
class ModelRef:
    """Which model the plan is for."""

    name: str
    """Preset name or local folder the plan was made from."""
    architecture: str
    """Hugging Face architecture, e.g. LlamaForCausalLM."""
    parameters: int
    """Parameter count (tied embeddings once)."""
    n_layers: int
    """Decoder layers."""


@dataclass(frozen=True)
class KVBudget:
    """What the KV cache is sized for."""

    max_batch: int
    """Sequences decoded together."""
    max_seq_len: int
    """Prompt plus generated tokens per sequence."""
    prefill_chunk: int
    """Tokens per sequence in one prefill forward (sets activation memory)."""


@dataclass(frozen=True)
class Offload:
    """Weights kept off the compute device and streamed in ahead of use."""

    tier: str = "none"
    """none | cpu (host RAM, when the compute device is a GPU) | disk."""
    layers: tuple[int, ...] = ()
    """Per stage, how many of its layers are offloaded (empty when tier is none)."""
    dir: str | None = None
    """Folder for disk offload."""


@dataclass(frozen=True)
class Serving:
    """Where `shardlm serve` listens."""

    host: str = "127.0.0.1"
    """Bind address."""
    port: int = 8000
    """HTTP port."""


@dataclass(frozen=True)
class Monitoring:
    """What the monitor exports."""

    metrics: bool = True
    """Expose Prometheus /metrics."""
    dashboard: bool = True
    """Serve the /dashboard page."""


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes on one rank."""

    rank: int
    """Global rank."""
    device: str
    """Device address "node:index"."""
    device_name: str
    """Device type, e.g. H100-80GB."""
    weights: int
    """Parameters this rank holds (replicated norms and KV heads included)."""
    kv_cache: int
    """KV cache for max_batch x max_seq_len."""
    activations: int
    """Peak activations and workspace of one forward."""
    overhead: int
    """Runtime overhead (CUDA context and NCCL, or Python and torch)."""
    capacity: int
    """Memory the device offers this rank."""
    offloaded: int = 0
    """Weight bytes kept off the device (streamed in)."""

    @property
    def total(self) -> int:
        """Predicted peak resident bytes."""
        return self.weights + self.kv_cache + self.activations + self.overhead


@dataclass(frozen=True)
class Performance:
    """Predicted speed."""

    prefill_tokens_per_s: float
    """Prompt tokens per second for a max_batch x prefill_chunk prefill."""
    decode_latency_s: float
    """Seconds per decode step (one token for every sequence of a batch)."""
    decode_tokens_per_s: float
    """Generated tokens per second across all replicas at max_batch."""
    single_stream_tokens_per_s: float
    """Tokens per second for one sequence alone (batch 1)."""
    stage_times_s: tuple[float, ...]
    """Decode-step time of each stage at max_batch."""
    bubble: float
    """Fraction of pipeline time idle in decode, (p-1)/(m+p-1) with m micro-batches."""
    micro_batches: int
    """Micro-batches the prediction assumes."""
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per decode step by cause: weights, kv, compute, collectives, p2p, overhead, offload."""

    @property
    def imbalance(self) -> float:
        """Slowest stage / mean stage time - 1."""
        mean = sum(self.stage_times_s) / len(self.stage_times_s)
        return max(self.stage_times_s) / mean - 1 if mean > 0 else 0.0


@dataclass(frozen=True)
class Predictions:
    """Memory per rank and speed."""

    memory: tuple[RankMemory, ...]
    """One entry per rank, rank order."""
    performance: Performance
    """Speed at the plan's batch and length."""
    assumptions: tuple[str, ...] = ()
    """What the numbers take for granted (efficiencies, uncalibrated figures)."""


@dataclass(frozen=True)
class Plan:
    """A deployment: model, numerics, layout, memory tiers, and what we predict for it."""

    model: ModelRef
    """The model."""
    cluster: str
    """Devices the plan is for: a shorthand (8xH100-80GB), a cluster file path, or "local"."""
    dtype: str
    """Compute and storage dtype of unquantized tensors."""
    quantization: str
    """Weight-only quantization of linear layers: none | int8 | int4."""
    layout: ParallelLayout
    """tp x pp x dp, stage layer ranges, devices."""
    kv: KVBudget
    """KV-cache sizing."""
    objective: str = "latency"
    """What the plan was ranked by: latency | throughput."""
    offload: Offload = Offload()
    """Offloaded layers per stage."""
    serving: Serving = Serving()
    """Server settings."""
    monitoring: Monitoring = Monitoring()
    """Monitor settings."""
    predictions: Predictions | None = None
    """Filled by the planner; recomputed by validate."""
