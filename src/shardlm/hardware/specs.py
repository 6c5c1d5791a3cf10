"""What a device offers and how devices group into nodes and clusters: the value types and their checks.

Units: sizes are binary (``GB`` = GiB = 2**30 bytes, as ``nvidia-smi`` and ``free`` print them); rates
and FLOP/s are decimal (``GB/s`` = 1e9 bytes/s, ``TFLOPS`` = 1e12), as datasheets write them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GiB = 2**30
MiB = 2**20

CALIBRATION_FILE = "calibration.json"

CUDA_LAYER_OVERHEAD_S = 65e-6
"""A decoder layer's fixed cost per decode step when the engine (`shardlm generate`, `serve`) replays the step as a
CUDA graph (one-GPU ranks): 64.5 us per layer beyond the bandwidth term (weight bytes / 0.8 x datasheet bandwidth)
for Llama-3.2-1B bfloat16 at batch 1 on one H100 (bench/gpu.py `--variants engine`, 2026-11-26 10:03-10:09: median
511.6 tok/s, steps run ahead, runtime/ahead.py). It includes the engine's own step (scheduling, the token back to the
driver). Without run-ahead the engine cost 83.7-90.1 us on an H200 (479.5-504.5 tok/s) and 81 us on the H100
(450.2 tok/s); runtime/step.generate's in-process replays cost 63 us on the H200 and 61.5 us on the H100."""
CUDA_EAGER_LAYER_OVERHEAD_S = 750e-6
"""The same when the host issues every kernel (tensor- or pipeline-parallel GPU ranks and streamed
layers, which the runtime does not capture): 0.72-0.75 ms per layer on that H100 machine's host.
It is host time, so a faster host CPU does better."""
CUDA_RUNTIME_BYTES = 1 * GiB  # CUDA context, cuBLAS workspace and NCCL buffers
CPU_DEFAULTS = {
    "bandwidth": 20e9,  # one worker's share of a dual-channel DDR4/DDR5 desktop, well below peak
    "flops": 50e9,  # fp32 on a few AVX2 cores
    "layer_overhead_s": 150e-6,  # Python dispatch of ~a dozen ops per layer
    "runtime_bytes": 420 * MiB,  # the Python interpreter plus torch, measured as RSS before loading weights
    "collective_latency_s": 10e-6,  # one gloo message between processes on one machine
}
DEFAULT_SOURCE = "default (run `shardlm calibrate` to measure this machine)"
UNKNOWN_GPU_SOURCE = "detected (unknown model: figures are guesses; describe it in a cluster YAML)"


class HardwareError(ValueError):
    """A device description (shorthand, cluster file, calibration file) cannot be used."""


@dataclass(frozen=True)
class DeviceSpec:
    """What one rank's device offers: capacity, speeds and fixed costs."""

    name: str
    """Catalog name such as ``H100-80GB``, or ``cpu-4GB`` for a CPU worker with a 4 GiB budget."""
    kind: str
    """``"cuda"`` or ``"cpu"``: picks the collective backend (NCCL or gloo) and the memory model."""
    memory_bytes: int
    """Memory one rank may use on this device, in bytes."""
    bandwidth: float
    """Memory bandwidth in bytes/s: decode speed is bound by streaming weights at this rate."""
    flops: float
    """Peak dense FLOP/s: 16-bit tensor-core figure for cuda, fp32 for cpu."""
    link_bandwidth: float
    """Device-to-device bandwidth inside a node, bytes/s per direction (NVLink, PCIe, or shared DRAM)."""
    link_latency: float
    """Seconds per message between devices of one node."""
    layer_overhead_s: float
    """Fixed seconds per decoder layer per forward step (kernel launches, Python dispatch)."""
    runtime_bytes: int
    """Memory a rank uses besides weights, KV cache and activations (CUDA context + NCCL, or Python + torch)."""
    source: str
    """Where the figures come from: ``datasheet``, ``calibrated <date>``, ``default (...)``, ``cluster file``."""
    host_bandwidth: float = 25e9
    """Host-to-device copy bandwidth from pinned memory, bytes/s: how fast layers offloaded to host RAM
    stream in (PCIe Gen4 x16 effective unless the catalog or a cluster file says otherwise)."""

    def __post_init__(self):
        if self.kind not in ("cuda", "cpu"):
            raise HardwareError(f"device {self.name!r} has kind {self.kind!r}; use 'cuda' or 'cpu'")
        for f in ("memory_bytes", "bandwidth", "flops", "link_bandwidth", "link_latency", "host_bandwidth"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise HardwareError(f"device {self.name!r} has {f}={value!r}; it must be a positive number")
        for f in ("layer_overhead_s", "runtime_bytes"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise HardwareError(f"device {self.name!r} has {f}={value!r}; it must be a number >= 0")


@dataclass(frozen=True)
class Device:
    """One device of a cluster: where it is and what it is."""

    node: int
    """Index of the node holding this device in ``Cluster.nodes``."""
    index: int
    """Index of this device inside its node."""
    spec: DeviceSpec
    """The device's figures."""

    @property
    def address(self) -> str:
        """``"node:index"``, e.g. ``"0:3"``."""
        return f"{self.node}:{self.index}"


@dataclass(frozen=True)
class Node:
    """One machine: its devices talk over the node's links, other nodes over the inter-node network."""

    name: str
    """Host name or a label (``node0``) used in messages."""
    devices: tuple[Device, ...]
    """The devices of this node, in index order."""
    shared_memory_bus: bool = False
    """True for CPU worker processes on one machine: they share DRAM bandwidth and cores."""
    cores: int | None = None
    """CPU cores on the node; None when not known or irrelevant."""


@dataclass(frozen=True)
class Cluster:
    """All nodes a model may use, plus the network between nodes."""

    nodes: tuple[Node, ...]
    """The nodes, in order; ``Device.node`` indexes this tuple."""
    inter_bandwidth: float = 50e9
    """Node-to-node bandwidth per device pair, bytes/s (default 50e9: 400 Gb/s InfiniBand)."""
    inter_latency: float = 5e-6
    """Seconds per message between nodes."""
    description: str = ""
    """The shorthand or file the cluster came from, for display."""

    def __post_init__(self):
        if not self.nodes:
            raise HardwareError("a cluster needs at least one node; e.g. parse_devices('1xH100-80GB')")
        for i, node in enumerate(self.nodes):
            if not node.devices:
                raise HardwareError(f"node {i} ({node.name!r}) has no devices; give it at least one")
            for j, device in enumerate(node.devices):
                if (device.node, device.index) != (i, j):
                    raise HardwareError(
                        f"device at node {i} position {j} says it is {device.address}; "
                        f"build it as Device(node={i}, index={j}, ...)"
                    )
        if self.inter_bandwidth <= 0 or self.inter_latency < 0:
            raise HardwareError(
                f"inter-node bandwidth {self.inter_bandwidth!r} must be > 0 and latency "
                f"{self.inter_latency!r} >= 0; e.g. bandwidth 50GB/s, latency 5us"
            )

    @property
    def devices(self) -> tuple[Device, ...]:
        """All devices, node-major (node 0's devices first)."""
        return tuple(d for node in self.nodes for d in node.devices)

    def describe(self) -> str:
        """Short text: ``8 x H100-80GB``, ``2 nodes x 8 x H100-80GB``, ``1 x RTX4090-24GB + 1 x A6000-48GB``."""
        runs: list[list[Any]] = []  # [node text, repeat count] for runs of identical consecutive nodes
        for node in self.nodes:
            text = _describe_node(node)
            if runs and runs[-1][0] == text:
                runs[-1][1] += 1
            else:
                runs.append([text, 1])
        if len(runs) == 1 and runs[0][1] == 1:
            return runs[0][0]
        parts = []
        for text, count in runs:
            body = f"({text})" if "+" in text else text
            parts.append(f"{count} node{'s' if count > 1 else ''} x {body}")
        return "; ".join(parts)


def _describe_node(node: Node) -> str:
    """``2 x A + 1 x B`` for the runs of identical consecutive devices of one node."""
    runs: list[list[Any]] = []  # [spec, count]
    for device in node.devices:
        if runs and runs[-1][0] == device.spec:
            runs[-1][1] += 1
        else:
            runs.append([device.spec, 1])
    return " + ".join(f"{count} x {spec.name}" for spec, count in runs)


def make_node(index: int, name: str, specs: list[DeviceSpec], cores: int | None = None) -> Node:
    """A node of ``specs`` at position ``index``; CPU-only nodes share one memory bus."""
    devices = tuple(Device(node=index, index=j, spec=s) for j, s in enumerate(specs))
    shared = all(s.kind == "cpu" for s in specs)
    return Node(name=name, devices=devices, shared_memory_bus=shared, cores=cores)
