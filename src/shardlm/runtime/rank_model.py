"""RankModel: what the rank builder returns, and everything the step code needs to run it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardlm.models.args import ModelArgs
from shardlm.plan.plan import RankSpec
from shardlm.quant import held_bytes
from shardlm.runtime.kvcache import KVCache


@dataclass(frozen=True)
class KernelChoice:
    """The kernels a rank runs, chosen once when it is built (runtime/build.py `choose_kernels`)."""

    linear: str
    """CPU linear kernels: gemv | onednn | torch; "cuda" on a GPU."""
    fused_layers: int
    """Decoder layers that run a decode step as one fused call (CPU, gemv, plain weights)."""
    cuda_graphs: bool
    """Decode steps replay as CUDA graphs (one GPU, no collectives, nothing streamed)."""
    compiled: bool = False
    """The CUDA-graph decode step is torch.compile'd before capture (SHARDLM_CUDA_COMPILE=1)."""
    joined_layers: int = 0
    """Layers whose q/k/v and gate/up run as one product each (GPU, runtime/projections.py)."""
    run_ahead: bool = False
    """The serving engine's greedy decode steps launch before the step ahead of them is read (runtime/ahead.py)."""
    shared_prefill: bool = True
    """Serving: prompt chunks of several requests may share a forward pass; False on one-GPU ranks with CUDA-graph
    decode by default, where a product's rounding of a row depends on the rows beside it (SHARDLM_BATCH_INVARIANT;
    runtime/serve_step.py)."""
    prefill_layers: int = 0
    """Decoder layers whose float32 prefill runs its element-wise work compiled (CPU, gemv; kernels/prefill.py)."""
    gemv_layers: int = 0
    """Decoder layers whose batch-1 decode runs as Triton GEMV kernels (one GPU, runtime/gpu_blocks.py)."""
    units: str = ""
    """The instructions the compiled CPU kernels were built for (kernels.build.units_of), "" without them."""

    def describe(self) -> str:
        """e.g. "gemv, fused decode in 30 layers"."""
        parts = [self.linear]
        if self.fused_layers:
            parts.append(f"fused decode in {self.fused_layers} layers")
        if self.prefill_layers:
            parts.append(f"fused prefill in {self.prefill_layers} layers")
        if self.joined_layers:
            parts.append(f"q/k/v and gate/up joined in {self.joined_layers} layers")
        if self.gemv_layers:
            parts.append(f"GEMV decode blocks in {self.gemv_layers} layers")
        if self.cuda_graphs:
            parts.append("compiled CUDA-graph decode" if self.compiled else "CUDA-graph decode")
        if self.run_ahead:
            parts.append("serving steps run ahead")
        if not self.shared_prefill:
            parts.append("a prompt chunk per pass")
        if self.units:
            parts.append(self.units)
        return ", ".join(parts)


@dataclass
class LoadStats:
    """How loading went."""

    load_s: float = 0.0
    """Seconds from the start of the build to a ready model."""
    rss_before_load: int = 0
    """Resident bytes of the process before any weight was read."""


@dataclass
class RankModel:
    """One rank's part of the model, built from its RankSpec, with what runs it."""

    module: nn.Module
    """The model (this stage's layers, tensor-parallel modules swapped in, weights loaded)."""
    spec: RankSpec
    """What it was built from."""
    args: ModelArgs
    """The model's shape."""
    device: torch.device
    """Where it runs."""
    dtype: torch.dtype
    """Dtype of activations, KV cache and unquantized weights."""
    kv_heads: int
    """KV heads this rank holds (its KV-cache width)."""
    kernels: KernelChoice
    """Its kernels."""
    streamer: object | None = None
    """The offload streamer (LayerStreamer on CPU, DeviceStreamer on a GPU), or None."""
    streamed: tuple[int, ...] = ()
    """Decoder layers that stream in."""
    mapped: frozenset[int] = frozenset()
    """ids of parameters used in place from the offload file (held by the page cache, not the rank)."""
    graphs: object | None = None
    """CUDA-graph decoders (runtime/cuda_graph.GraphDecoders) when `kernels.cuda_graphs`."""
    stats: LoadStats = field(default_factory=LoadStats)
    ops: object | None = None
    """The compiled CPU kernels (kernels/build.py) where this rank runs them (kernels.linear "gemv"), else None."""

    @property
    def layer_ids(self) -> list[int]:
        """The decoder layers this rank runs, in order."""
        return [int(k) for k in self.module.model.layers.keys()]

    def new_cache(self, batch: int, length: int) -> KVCache:
        """A KV cache for `batch` sequences of up to `length` tokens over this rank's layers."""
        return KVCache(self.layer_ids, batch, self.kv_heads, length, self.args.head_dim, self.dtype, self.device)

    def resident_bytes(self) -> int:
        """Weight bytes this rank holds: parameters, kernel weights and the streamer's read buffers (not the
        layers streamed out, nor rows used in place from a file)."""
        buffers = self.streamer.resident_buffer_bytes() if self.streamer is not None else 0
        return held_bytes(self.module, self.mapped) + buffers

    def streamed_bytes_per_step(self) -> int:
        """Bytes brought in per forward pass."""
        return self.streamer.bytes_per_pass if self.streamer is not None else 0

    def close(self) -> None:
        """Stop the streamer and remove its scratch file."""
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """Run the module (see the model's `forward`)."""
        return self.module(*args, **kwargs)
