"""The Plan: what the planner decided and what it predicts. The manifest is its YAML form.

The Plan is the single source of truth downstream: the sharder, the loader, the runtime and the
monitor read it; none re-derives a layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.plan.layout import ParallelLayout

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
QUANTIZATIONS = ("none", "int8", "int4")
EMBEDDINGS = ("float", "int8")
"""How the token embedding (and a head tied to it) may be held: see Plan.embedding."""
OFFLOAD_TIERS = ("none", "cpu", "disk")
OBJECTIVES = ("latency", "throughput")
IMBALANCE_LIMIT = 0.15
"""Largest allowed stage-time imbalance (slowest stage / mean stage time - 1) before validation fails."""


class PlanError(ValueError):
    """A plan that cannot be made or run as asked; the message has the numbers and the fix."""


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
    prefetch: bool = True
    """Read the next offloaded layer while the current one computes."""
    vocab: tuple[bool, ...] = ()
    """Per stage, whether its embedding / float LM head is also used in place from the offload file, a
    block of rows at a time (when even streaming every layer would not fit; disk tier only). Empty: none."""

    def stage_layers(self, stage: int) -> int:
        """How many of `stage`'s layers are offloaded (its last ones)."""
        return self.layers[stage] if self.tier != "none" and self.layers else 0

    def stage_vocab(self, stage: int) -> bool:
        """Whether `stage` uses its embedding / head in place from the offload file."""
        return bool(self.vocab) and self.vocab[stage]


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
    device: str = "cpu"
    """Kind of device the ranks run on: cpu | cuda (for a "local" cluster the run's --device decides)."""
    micro_batches: int = 0
    """Micro-batches in flight through the pipeline stages; 0 picks one per stage (capped by the batch)."""
    embedding: str = "float"
    """How the token embedding, and an LM head tied to it, are held: float (in `dtype`) | int8 (codes with a
    scale per row, `--quantize-embedding`)."""

    @property
    def world(self) -> int:
        """Rank processes the plan runs."""
        return self.layout.world

    def rank_spec(self, rank: int) -> "RankSpec":
        """What global `rank` builds and runs: its coordinates, layers, neighbours, numerics and tiers."""
        lay = self.layout
        c = lay.coord(rank)
        a, b = lay.stage_layers[c.stage]
        at = lambda stage: lay.rank_of(c.replica, stage, c.tp_rank)  # noqa: E731 - same tp rank, another stage
        return RankSpec(
            rank=rank, world=lay.world, replica=c.replica, stage=c.stage, tp_rank=c.tp_rank, tp=lay.tp, pp=lay.pp,
            layers=(a, b), address=c.device, device=self.device, dtype=self.dtype, quantization=self.quantization,
            offload=RankOffload(self.offload.tier if self.offload.stage_layers(c.stage) or
                                self.offload.stage_vocab(c.stage) else "none",
                                self.offload.stage_layers(c.stage), self.offload.stage_vocab(c.stage),
                                self.offload.dir, self.offload.prefetch),
            kv=self.kv, micro_batches=self.micro_batches, tp_groups=tuple(lay.tp_groups()),
            prev=at(c.stage - 1) if c.stage > 0 else None, next=at(c.stage + 1) if c.stage < lay.pp - 1 else None,
            first=at(0), last=at(lay.pp - 1), embedding=self.embedding)


@dataclass(frozen=True)
class RankOffload:
    """One rank's offloaded weights: which tier, how many of its stage's last layers, the vocabulary."""

    tier: str
    """none | cpu (pinned host RAM, GPU ranks) | disk (a scratch file, CPU ranks)."""
    layers: int
    """The stage's last `layers` decoder layers stream in ahead of use."""
    vocab: bool
    """The embedding / float LM head is used in place from the scratch file, a block of rows at a time."""
    dir: str | None
    """Folder for the scratch file (disk tier)."""
    prefetch: bool
    """Bring the next streamed layer in while the current one computes."""


@dataclass(frozen=True)
class RankSpec:
    """Everything one rank needs from the Plan (plan.rank_spec(rank)): it re-derives nothing."""

    rank: int
    """Global rank."""
    world: int
    """Ranks in the whole plan."""
    replica: int
    """Data-parallel replica."""
    stage: int
    """Pipeline stage."""
    tp_rank: int
    """Position in its tensor-parallel group."""
    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline stages."""
    layers: tuple[int, int]
    """[start, stop) decoder layers of its stage."""
    address: str
    """Device address "node:index" in the plan's cluster."""
    device: str
    """cpu | cuda."""
    dtype: str
    """Compute and storage dtype of unquantized tensors."""
    quantization: str
    """none | int8 | int4."""
    offload: RankOffload
    """Its offloaded weights."""
    kv: KVBudget
    """What its KV cache is sized for."""
    micro_batches: int
    """Pipeline micro-batches (0: one per stage, capped by the batch)."""
    tp_groups: tuple[tuple[int, ...], ...]
    """The ranks of every tensor-parallel group of the plan, in the order every rank creates them."""
    prev: int | None
    """Rank of the previous stage with the same tp rank (None on the first stage)."""
    next: int | None
    """Rank of the next stage with the same tp rank (None on the last stage)."""
    first: int
    """Rank of the first stage with the same tp rank (where the last stage sends sampled tokens)."""
    last: int
    """Rank of the last stage with the same tp rank."""
    embedding: str = "float"
    """float | int8: the token embedding and a head tied to it as int8 codes (Plan.embedding)."""

    @classmethod
    def single(cls, n_layers: int, dtype: str = "float32", quantization: str = "none", device: str = "cpu",
               kv: KVBudget = KVBudget(1, 4096, 2048)) -> "RankSpec":
        """The spec of a one-rank run of a whole model (perplexity scoring, calibration, tests)."""
        return cls(rank=0, world=1, replica=0, stage=0, tp_rank=0, tp=1, pp=1, layers=(0, n_layers), address="0:0",
                   device=device, dtype=dtype, quantization=quantization,
                   offload=RankOffload("none", 0, False, None, True), kv=kv, micro_batches=0, tp_groups=((0,),),
                   prev=None, next=None, first=0, last=0)

    @property
    def first_stage(self) -> bool:
        """Holds the embedding (takes token ids)."""
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        """Holds the final norm and the LM head (produces logits)."""
        return self.stage == self.pp - 1

    @property
    def tp_group(self) -> tuple[int, ...]:
        """The ranks of its own tensor-parallel group."""
        return self.tp_groups[self.replica * self.pp + self.stage]
