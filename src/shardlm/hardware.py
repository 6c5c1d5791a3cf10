"""The devices a model runs on: specs, nodes and clusters, from a shorthand, a YAML file or this machine.

A ``DeviceSpec`` holds the few figures the planner needs (memory, memory bandwidth, peak FLOP/s, link
bandwidth and latency, fixed per-layer overhead, runtime memory). They come from a small datasheet
``CATALOG`` for known GPUs, from ``$SHARDLM_HOME/calibration.json`` (written by ``shardlm calibrate``)
for CPU worker processes, or from a cluster YAML file for anything else.

Three ways in:

- ``parse_devices("2x8xH100-80GB")``: a shorthand; ``2xcpu-4GB`` means two CPU worker processes with
  4 GiB each on this machine.
- ``load_cluster("cluster.yaml")``: a file; errors name the field path and the line.
- ``detect_local()``: the GPUs of this machine, or one CPU worker using the available memory.

Units: sizes are binary (``GB`` = GiB = 2**30 bytes, as ``nvidia-smi`` and ``free`` print them); rates
and FLOP/s are decimal (``GB/s`` = 1e9 bytes/s, ``TFLOPS`` = 1e12), as datasheets write them.

This is a low floor: it imports only the standard library, yaml and psutil (torch lazily, in
``detect_local``).
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import psutil
import yaml

from shardlm.paths import home as shardlm_home

GiB = 2**30
MiB = 2**20

CALIBRATION_FILE = "calibration.json"

CUDA_LAYER_OVERHEAD_S = 100e-6
"""A decoder layer's fixed cost per decode step when the step is replayed as a CUDA graph (one-GPU
ranks): measured on one H100, 94-99 us per layer beyond the bandwidth term (bench/gpu.py, 2026-11-22)."""
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


# ---------------------------------------------------------------------------------------------------
# Catalog


PCIE_GEN5_HOST = 55e9
"""Pinned host-to-device copies on a PCIe Gen5 x16 GPU: 54.7-55.1 GB/s measured on one H100 80GB HBM3
(bench/gpu.py, 2026-11-22)."""
PCIE_GEN4_HOST = 25e9
"""The same on PCIe Gen4 x16: half the Gen5 link, assumed (not measured here)."""
PCIE_GEN3_HOST = 12e9
"""The same on PCIe Gen3 x16, assumed."""


def _cuda(name: str, mib: int, bandwidth: float, flops: float, link: float, latency: float,
          host: float = PCIE_GEN4_HOST) -> DeviceSpec:
    """A datasheet cuda spec; memory in MiB as the driver reports it; `host` the pinned host-to-device rate."""
    return DeviceSpec(
        name=name, kind="cuda", memory_bytes=mib * MiB, bandwidth=bandwidth, flops=flops,
        link_bandwidth=link, link_latency=latency, layer_overhead_s=CUDA_LAYER_OVERHEAD_S,
        runtime_bytes=CUDA_RUNTIME_BYTES, source="datasheet", host_bandwidth=host,
    )


CATALOG: dict[str, DeviceSpec] = {
    s.name: s
    for s in (
        _cuda("H100-80GB", 81559, 3.35e12, 989e12, 450e9, 2e-6, PCIE_GEN5_HOST),  # NVIDIA H100 datasheet (SXM5)
        _cuda("H200-141GB", 143771, 4.8e12, 989e12, 450e9, 2e-6, PCIE_GEN5_HOST),  # NVIDIA H200 datasheet (SXM)
        _cuda("A100-80GB", 81920, 2.039e12, 312e12, 300e9, 2e-6),  # NVIDIA A100 Tensor Core GPU datasheet (SXM4)
        _cuda("A100-40GB", 40960, 1.555e12, 312e12, 300e9, 2e-6),  # NVIDIA A100 Tensor Core GPU datasheet (40GB)
        _cuda("L40S-48GB", 46068, 864e9, 362e12, 25e9, 10e-6),  # NVIDIA L40S datasheet; PCIe Gen4 x16 effective
        _cuda("A6000-48GB", 49140, 768e9, 154.8e12, 25e9, 10e-6),  # NVIDIA RTX A6000 datasheet; PCIe Gen4
        _cuda("RTX4090-24GB", 24564, 1.008e12, 165.2e12, 25e9, 10e-6),  # NVIDIA Ada Lovelace architecture whitepaper
        _cuda("RTX3090-24GB", 24576, 936e9, 71e12, 25e9, 10e-6),  # NVIDIA Ampere GA102 GPU architecture whitepaper
        _cuda("L4-24GB", 23034, 300e9, 121e12, 25e9, 10e-6),  # NVIDIA L4 Tensor Core GPU datasheet
        _cuda("A10-24GB", 23028, 600e9, 125e12, 25e9, 10e-6),  # NVIDIA A10 Tensor Core GPU datasheet
        _cuda("T4-16GB", 15360, 320e9, 65e12, 12e9, 10e-6, PCIE_GEN3_HOST),  # NVIDIA T4 datasheet; PCIe Gen3
    )
}
"""Known devices by canonical name, with datasheet figures."""

ALIASES = {
    "H100": "H100-80GB", "H200": "H200-141GB", "L40S": "L40S-48GB", "A6000": "A6000-48GB",
    "RTX4090": "RTX4090-24GB", "RTX3090": "RTX3090-24GB", "L4": "L4-24GB", "A10": "A10-24GB", "T4": "T4-16GB",
}
"""Short names accepted by ``lookup`` (upper case) -> canonical catalog name."""

# Canonical name -> the word of torch.cuda.get_device_name() that identifies the model.
_GPU_WORDS = {
    "H100-80GB": "H100", "H200-141GB": "H200", "A100-80GB": "A100", "A100-40GB": "A100", "L40S-48GB": "L40S",
    "A6000-48GB": "A6000", "RTX4090-24GB": "4090", "RTX3090-24GB": "3090", "L4-24GB": "L4", "A10-24GB": "A10",
    "T4-16GB": "T4",
}
_GPU_MEMORY_TOLERANCE = 0.10  # a detected GPU matches a catalog entry when memory is within 10%


def lookup(name: str) -> DeviceSpec:
    """The catalog spec for ``name`` (a canonical name or alias, any case).

    Unknown names raise ``HardwareError`` with the closest known names; devices not in the catalog
    must be described in a cluster YAML file with memory, bandwidth and flops.
    """
    key = name.strip().upper()
    by_upper = {k.upper(): k for k in CATALOG}
    canonical = by_upper.get(key) or ALIASES.get(key)
    if canonical is not None:
        return CATALOG[canonical]
    if key.startswith("CPU"):
        raise HardwareError(
            f"{name!r} is not a catalog device: CPU workers are written with their memory, e.g. 2xcpu-4GB"
        )
    same_model = [k for k in CATALOG if k.upper().split("-")[0] == key]  # "A100": both memory sizes
    close = difflib.get_close_matches(key, list(by_upper) + list(ALIASES), n=3, cutoff=0.5)
    names = list(dict.fromkeys(same_model + [by_upper.get(c) or ALIASES[c] for c in close]))[:3]
    hint = f"did you mean {' or '.join(names)}? " if names else ""
    raise HardwareError(
        f"unknown device {name!r}; {hint}known devices: {', '.join(CATALOG)}. A device not in this list "
        "must be described in a cluster YAML file with memory, bandwidth and flops, e.g. "
        "{type: my-accel, count: 1, memory: 40GB, bandwidth: 1.2TB/s, flops: 200TFLOPS}"
    )


# ---------------------------------------------------------------------------------------------------
# Units

_NUMBER = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([^\s\d].*?)?\s*$")
_SIZE_UNITS = {
    "": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": MiB, "MB": MiB, "MIB": MiB,
    "G": GiB, "GB": GiB, "GIB": GiB, "T": 2**40, "TB": 2**40, "TIB": 2**40,
}
_RATE_UNITS = {"": 1, "B/S": 1, "KB/S": 1e3, "MB/S": 1e6, "GB/S": 1e9, "TB/S": 1e12}
_FLOPS_UNITS = {
    "": 1, "FLOPS": 1, "FLOP/S": 1, "GFLOPS": 1e9, "GFLOP/S": 1e9, "TFLOPS": 1e12, "TFLOP/S": 1e12,
    "PFLOPS": 1e15, "PFLOP/S": 1e15,
}
_SECONDS_UNITS = {"": 1, "S": 1, "MS": 1e-3, "US": 1e-6, "µS": 1e-6, "NS": 1e-9}


def _parse_quantity(value: Any, units: dict[str, float], what: str, example: str) -> float:
    """A non-negative number with an optional unit from ``units`` (case-insensitive), in base units."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise HardwareError(f"expected {what} like {example}, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _NUMBER.match(value)
        if match is None:
            raise HardwareError(f"cannot read {value!r} as {what}; write it like {example}")
        number, unit = float(match.group(1)), (match.group(2) or "").upper()
        if unit not in units:
            known = ", ".join(u for u in units if u)
            raise HardwareError(f"unknown unit {match.group(2)!r} in {value!r} for {what}; use one of {known}")
    if number < 0:
        raise HardwareError(f"{what} {value!r} is negative; write it like {example}")
    scale = units[unit]
    return number * scale if scale >= 1 else number / round(1 / scale)  # 10 / 1e6, not 10 * 1e-6 (inexact)


def parse_size(text: str | int | float) -> int:
    """Bytes in a size such as ``"4GB"``, ``"4GiB"``, ``"300MB"``, ``"1.5TB"`` or ``"512"`` (bytes).

    Sizes are binary: ``GB`` means GiB (2**30 bytes), as ``nvidia-smi`` and ``free`` print them, so
    ``"4GB"`` and ``"4GiB"`` are the same 4294967296 bytes. Plain numbers are bytes.
    """
    return int(_parse_quantity(text, _SIZE_UNITS, "a size", "4GB, 300MB or 1.5TB"))


def _parse_rate(text: Any) -> float:
    """Bytes/s in a rate such as ``"50GB/s"`` or ``"1.2TB/s"`` (decimal, as datasheets write them)."""
    return _parse_quantity(text, _RATE_UNITS, "a bandwidth in bytes per second", "50GB/s or 1.2TB/s")


def _parse_flops(text: Any) -> float:
    """FLOP/s in ``"200TFLOPS"``, ``"500GFLOPS"`` or ``"1PFLOPS"`` (decimal)."""
    return _parse_quantity(text, _FLOPS_UNITS, "a compute rate", "200TFLOPS or 500GFLOPS")


def _parse_seconds(text: Any) -> float:
    """Seconds in ``"5us"``, ``"2ms"``, ``"800ns"`` or ``"0.001s"``."""
    return _parse_quantity(text, _SECONDS_UNITS, "a duration", "5us, 2ms or 800ns")


def _short_size(n: int) -> str:
    """``4GB`` / ``512MB``: the largest binary unit that divides ``n``, else GB to 0.1 (GB means GiB)."""
    for unit, scale in (("TB", 2**40), ("GB", GiB), ("MB", MiB)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n / GiB:.1f}GB"


# ---------------------------------------------------------------------------------------------------
# CPU workers and calibration


def _check_calibration(data: Any, where: str) -> dict:
    """Return ``data`` if it looks like a calibration (``{"date": ..., "cpu": {...}}``), else raise."""
    fix = "fix: run `shardlm calibrate` again, or delete the file to use defaults"
    if not isinstance(data, dict) or not isinstance(data.get("cpu"), dict):
        raise HardwareError(f"{where}: a calibration must be an object with a 'cpu' object; {fix}")
    for key, value in data["cpu"].items():
        if key in CPU_DEFAULTS or key == "cores":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise HardwareError(f"{where}: cpu.{key} is {value!r}, not a positive number; {fix}")
    cores = data["cpu"].get("cores")
    if cores is not None and not isinstance(cores, int):
        raise HardwareError(f"{where}: cpu.cores is {cores!r}, not a whole number; {fix}")
    return data


def read_calibration(home: Path | None = None) -> dict | None:
    """The calibration written by ``shardlm calibrate``: ``<home>/calibration.json``, or None if absent.

    ``home`` defaults to ``$SHARDLM_HOME`` (else ``~/.cache/shardlm``). A file that is not valid JSON
    or lacks a ``cpu`` object of positive numbers raises ``HardwareError``.
    """
    path = Path(home if home is not None else shardlm_home()).expanduser() / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HardwareError(
            f"{path}: cannot read calibration ({exc}); fix: run `shardlm calibrate` again, or delete the file"
        ) from exc
    return _check_calibration(data, str(path))


def cpu_spec(memory_bytes: int, calibration: dict | None = None) -> DeviceSpec:
    """A CPU worker process with a ``memory_bytes`` budget on this machine.

    Speeds come from ``calibration["cpu"]`` (keys ``bandwidth``, ``flops``, ``layer_overhead_s``,
    ``runtime_bytes``, ``collective_latency_s``; missing keys use defaults) when given, else from
    conservative defaults. Workers share DRAM, so the link bandwidth is the memory bandwidth.
    """
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0:
        raise HardwareError(
            f"a CPU worker needs a positive memory budget in bytes, got {memory_bytes!r}; e.g. 4 * GiB"
        )
    figures = dict(CPU_DEFAULTS)
    source = DEFAULT_SOURCE
    if calibration is not None:
        _check_calibration(calibration, "calibration")
        figures.update({k: v for k, v in calibration["cpu"].items() if k in CPU_DEFAULTS})
        source = f"calibrated {calibration.get('date', '(undated)')}"
    return DeviceSpec(
        name=f"cpu-{_short_size(memory_bytes)}", kind="cpu", memory_bytes=memory_bytes,
        bandwidth=float(figures["bandwidth"]), flops=float(figures["flops"]),
        link_bandwidth=float(figures["bandwidth"]), link_latency=float(figures["collective_latency_s"]),
        layer_overhead_s=float(figures["layer_overhead_s"]), runtime_bytes=int(figures["runtime_bytes"]),
        source=source,
    )


def _cpu_cores(calibration: dict | None) -> int | None:
    """Cores of this machine: the calibrated count, else ``os.cpu_count()``."""
    if calibration is not None and calibration["cpu"].get("cores"):
        return int(calibration["cpu"]["cores"])
    return os.cpu_count()


def _make_node(index: int, name: str, specs: list[DeviceSpec], cores: int | None = None) -> Node:
    """A node of ``specs`` at position ``index``; CPU-only nodes share one memory bus."""
    devices = tuple(Device(node=index, index=j, spec=s) for j, s in enumerate(specs))
    shared = all(s.kind == "cpu" for s in specs)
    return Node(name=name, devices=devices, shared_memory_bus=shared, cores=cores)


# ---------------------------------------------------------------------------------------------------
# Shorthand

_COUNT_PREFIX = re.compile(r"^\s*([+-]?(?:\d[\d.]*|\.\d+))\s*[xX×]\s*(.*)$")
_CPU_NAME = re.compile(r"^cpu(?:[-_ ]?(.*))?$", re.IGNORECASE)
SHORTHAND_EXAMPLE = "8xH100-80GB, 2x8xH100-80GB, 1xRTX4090-24GB,1xA6000-48GB or 2xcpu-4GB"


def _count(text: str, group: str) -> int:
    """A device or node count from a shorthand group: a whole number >= 1."""
    if not re.fullmatch(r"\+?\d+", text) or int(text) < 1:
        raise HardwareError(
            f"bad count {text!r} in {group!r}: counts are whole numbers >= 1; e.g. {SHORTHAND_EXAMPLE}"
        )
    return int(text)


def _parse_group(group: str, calibration: Callable[[], dict | None]) -> tuple[int | None, int, DeviceSpec]:
    """``[M x ][N x ]NAME`` -> (nodes M or None, devices per node N, spec)."""
    counts, rest = [], group
    while (match := _COUNT_PREFIX.match(rest)) is not None:
        counts.append(_count(match.group(1), group))
        rest = match.group(2)
    name = rest.strip()
    if len(counts) > 2:
        raise HardwareError(f"too many counts in {group!r}: write M x N x NAME at most, e.g. 2x8xH100-80GB")
    if not name:
        raise HardwareError(f"no device name in {group!r}; e.g. {SHORTHAND_EXAMPLE}")
    cpu = _CPU_NAME.match(name)
    if cpu is not None:
        if not cpu.group(1):
            n = counts[-1] if counts else 1
            raise HardwareError(f"{group!r}: give the memory per worker, e.g. {n}xcpu-4GB")
        try:
            memory = parse_size(cpu.group(1))
        except HardwareError as exc:
            raise HardwareError(f"{group!r}: {exc}; e.g. 2xcpu-4GB") from exc
        if memory <= 0:
            raise HardwareError(f"{group!r}: a CPU worker needs memory > 0, e.g. 2xcpu-4GB")
        spec = cpu_spec(memory, calibration())
    else:
        try:
            spec = lookup(name)
        except HardwareError as exc:
            raise HardwareError(f"in {group!r}: {exc}") from exc
    nodes = counts[0] if len(counts) == 2 else None
    return nodes, (counts[-1] if counts else 1), spec


def parse_devices(text: str) -> Cluster:
    """A cluster from a shorthand such as ``8xH100-80GB`` or ``2x8xH100-80GB``.

    Comma-separated groups, each ``[N x ]NAME`` or ``M x N x NAME`` (``x``, ``X`` or ``×``). Groups
    without a node count share one node (``1xRTX4090-24GB,1xA6000-48GB`` is one node with two
    devices); ``M x N x NAME`` appends M nodes of N devices. ``cpu-4GB`` is a CPU worker process with
    a 4 GiB budget on this machine, with figures from ``read_calibration()`` when present. CPU and
    cuda devices cannot be mixed in one shorthand.
    """
    if not isinstance(text, str) or not text.strip():
        raise HardwareError(f"no devices given ({text!r}); e.g. {SHORTHAND_EXAMPLE}")
    calibration = functools.cache(read_calibration)  # read at most once, and only for cpu groups
    layout: list[tuple[str, list[DeviceSpec]]] = []  # ("shared" | "own", specs) per node
    for group in text.split(","):
        if not group.strip():
            raise HardwareError(f"empty group in {text!r} (a stray comma?); e.g. {SHORTHAND_EXAMPLE}")
        nodes, per_node, spec = _parse_group(group.strip(), calibration)
        if nodes is None:
            if not any(tag == "shared" for tag, _ in layout):
                layout.append(("shared", []))  # the shared node sits where its first group appears
            next(specs for tag, specs in layout if tag == "shared").extend([spec] * per_node)
        else:
            layout.extend(("own", [spec] * per_node) for _ in range(nodes))
    kinds = {s.kind for _, specs in layout for s in specs}
    if len(kinds) > 1:
        raise HardwareError(
            f"{text!r} mixes cpu workers and cuda devices, which is not supported; use one kind, "
            "e.g. 2xcpu-4GB or 2xRTX4090-24GB"
        )
    cores = _cpu_cores(calibration()) if kinds == {"cpu"} else None
    nodes_ = tuple(_make_node(i, f"node{i}", specs, cores) for i, (_, specs) in enumerate(layout))
    return Cluster(nodes=nodes_, description=text.strip())


# ---------------------------------------------------------------------------------------------------
# Cluster YAML

CLUSTER_EXAMPLE = "nodes: [{name: box-a, devices: [{type: RTX4090-24GB, count: 2}]}]"
UNKNOWN_DEVICE_EXAMPLE = "{type: my-accel, count: 1, memory: 40GB, bandwidth: 1.2TB/s, flops: 200TFLOPS}"
# YAML key -> (DeviceSpec field, parser)
def _positive(parse: Callable[[Any], Any], example: str) -> Callable[[Any], Any]:
    """``parse`` that also rejects zero."""

    def parse_positive(value: Any) -> Any:
        result = parse(value)
        if result <= 0:
            raise HardwareError(f"{value!r} must be greater than zero, e.g. {example}")
        return result

    return parse_positive


_DEVICE_FIELDS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "memory": ("memory_bytes", _positive(parse_size, "40GB")),
    "bandwidth": ("bandwidth", _positive(_parse_rate, "1.2TB/s")),
    "flops": ("flops", _positive(_parse_flops, "200TFLOPS")),
    "link_bandwidth": ("link_bandwidth", _positive(_parse_rate, "25GB/s")),
    "link_latency": ("link_latency", _positive(_parse_seconds, "10us")),
    "host_bandwidth": ("host_bandwidth", _positive(_parse_rate, "25GB/s")),
    "layer_overhead": ("layer_overhead_s", _parse_seconds),
    "runtime_memory": ("runtime_bytes", parse_size),
}
_UNKNOWN_DEFAULTS = {  # figures for a non-catalog accelerator that the file does not give
    "link_bandwidth": 25e9, "link_latency": 10e-6, "layer_overhead_s": CUDA_LAYER_OVERHEAD_S,
    "runtime_bytes": CUDA_RUNTIME_BYTES,
}


@dataclass(frozen=True)
class _Where:
    """A cluster file and its composed YAML tree, to turn a field path into a line number."""

    file: str
    """The file name, for messages."""
    root: yaml.Node | None
    """The composed document (None for an empty file)."""

    def line(self, path: tuple) -> int:
        """Line of the deepest node along ``path`` that exists (1-based)."""
        node, line = self.root, 1 if self.root is None else self.root.start_mark.line + 1
        for part in path:
            if isinstance(node, yaml.MappingNode):
                node = next((v for k, v in node.value if k.value == part), None)
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                node = node.value[part]
            else:
                node = None
            if node is None:
                break
            line = node.start_mark.line + 1
        return line

    def error(self, path: tuple, problem: str) -> HardwareError:
        """``file: line N: nodes[0].devices[1].bandwidth: problem``."""
        dotted = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "top level"
        return HardwareError(f"{self.file}: line {self.line(path)}: {dotted}: {problem}")

    def get(self, mapping: dict, path: tuple, key: str, parser: Callable[[Any], Any], default: Any = None) -> Any:
        """``parser(mapping[key])``, or ``default`` when absent; parse errors name the path and line."""
        if key not in mapping:
            return default
        try:
            return parser(mapping[key])
        except HardwareError as exc:
            raise self.error(path + (key,), str(exc)) from None

    def mapping(self, value: Any, path: tuple, allowed: set[str], example: str) -> dict:
        """``value`` checked to be a mapping whose keys are all in ``allowed``."""
        if not isinstance(value, dict):
            raise self.error(path, f"expected a mapping, got {value!r}; e.g. {example}")
        for key in value:
            if key not in allowed:
                raise self.error(path + (key,), f"unknown key {key!r}; allowed: {', '.join(sorted(allowed))}")
        return value


def _positive_int(value: Any) -> int:
    """``value`` if it is a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HardwareError(f"expected a whole number >= 1, got {value!r}")
    return value


def _yaml_device(
    where: _Where, raw: Any, path: tuple, calibration: Callable[[], dict | None]
) -> tuple[DeviceSpec, int]:
    """One ``devices`` entry -> (spec, count)."""
    entry = where.mapping(raw, path, {"type", "count", *_DEVICE_FIELDS}, UNKNOWN_DEVICE_EXAMPLE)
    kind = entry.get("type")
    if not isinstance(kind, str) or not kind.strip():
        raise where.error(path + ("type",), f"give the device type, e.g. {{type: H100-80GB, count: 8}}, not {kind!r}")
    count = where.get(entry, path, "count", _positive_int, 1)
    given = {f: where.get(entry, path, key, parse) for key, (f, parse) in _DEVICE_FIELDS.items() if key in entry}
    if kind.strip().lower() == "cpu":
        if "memory_bytes" not in given:
            raise where.error(
                path + ("memory",), "a cpu worker needs its memory budget, e.g. {type: cpu, count: 2, memory: 4GB}"
            )
        spec = cpu_spec(given["memory_bytes"], calibration())
        if "bandwidth" in given and "link_bandwidth" not in given:
            given["link_bandwidth"] = given["bandwidth"]  # workers share DRAM
        spec = replace(spec, **given, source="cluster file") if len(given) > 1 else spec
        return spec, count
    try:
        base = lookup(kind)
    except HardwareError:
        base = None
    if base is not None:
        return (replace(base, **given, source="cluster file") if given else base), count
    for key, f in (("memory", "memory_bytes"), ("bandwidth", "bandwidth"), ("flops", "flops")):
        if f not in given:
            close = difflib.get_close_matches(kind.upper(), [k.upper() for k in CATALOG], n=1, cutoff=0.6)
            hint = f" (or did you mean {close[0]}?)" if close else ""
            raise where.error(
                path + (key,),
                f"{kind!r} is not in the catalog, so memory, bandwidth and flops are required and {key} is missing; "
                f"fix: add them, e.g. {UNKNOWN_DEVICE_EXAMPLE}{hint}",
            )
    figures = {**_UNKNOWN_DEFAULTS, **given}
    return DeviceSpec(name=kind.strip(), kind="cuda", source="cluster file", **figures), count


def _yaml_node(where: _Where, raw: Any, i: int, calibration: Callable[[], dict | None]) -> Node:
    """One ``nodes`` entry -> Node at position ``i``."""
    path = ("nodes", i)
    entry = where.mapping(raw, path, {"name", "devices", "cores"}, CLUSTER_EXAMPLE)
    name = entry.get("name", f"node{i}")
    if not isinstance(name, (str, int)) or isinstance(name, bool):
        raise where.error(path + ("name",), f"expected a name such as box-a, got {name!r}")
    devices = entry.get("devices")
    if not isinstance(devices, list) or not devices:
        raise where.error(
            path + ("devices",),
            f"list at least one device, e.g. devices: [{{type: H100-80GB, count: 8}}], not {devices!r}",
        )
    specs: list[DeviceSpec] = []
    for j, raw_device in enumerate(devices):
        spec, count = _yaml_device(where, raw_device, path + ("devices", j), calibration)
        if specs and spec.kind != specs[0].kind:
            raise where.error(
                path + ("devices", j),
                "mixes cpu workers and cuda devices in one node, which is not supported; "
                "fix: put the cpu workers in a node of their own",
            )
        specs.extend([spec] * count)
    cores = where.get(entry, path, "cores", _positive_int)
    if cores is None and specs[0].kind == "cpu":
        cores = _cpu_cores(calibration())
    return _make_node(i, str(name), specs, cores)


def _read_yaml(path: Path) -> tuple[Any, _Where]:
    """Parse a cluster file into (data, _Where); missing files and YAML syntax errors raise HardwareError."""
    if not path.is_file():
        raise HardwareError(
            f"cluster file {path} not found; fix: check the path, or give the devices as a shorthand "
            "such as 2xH100-80GB"
        )
    try:
        text = path.read_text()
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise HardwareError(f"cannot read cluster file {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or str(exc)
        raise HardwareError(f"{path}: line {line}: not valid YAML ({problem}); fix the syntax there") from exc
    return data, _Where(str(path), root)


def load_cluster(path: str | Path) -> Cluster:
    """A cluster from a YAML file: ``nodes`` (each with ``name`` and ``devices``) and optional ``inter_node``.

    Catalog devices need only ``type`` and ``count`` and may override figures (``memory``, ``bandwidth``,
    ``flops``, ``link_bandwidth``, ``link_latency``, ``host_bandwidth``, ``layer_overhead``, ``runtime_memory``); other types
    must give ``memory``, ``bandwidth`` and ``flops``. ``type: cpu`` needs ``memory`` per worker. Errors
    name the file, the field path (``nodes[0].devices[1].bandwidth``) and the line.
    """
    path = Path(path)
    data, where = _read_yaml(path)
    top = where.mapping(data, (), {"nodes", "inter_node"}, CLUSTER_EXAMPLE)
    raw_nodes = top.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise where.error(("nodes",), f"list at least one node, e.g. {CLUSTER_EXAMPLE}; got {raw_nodes!r}")
    calibration = functools.cache(read_calibration)  # read at most once, and only for cpu nodes
    nodes = tuple(_yaml_node(where, raw, i, calibration) for i, raw in enumerate(raw_nodes))
    inter = where.mapping(top.get("inter_node", {}), ("inter_node",), {"bandwidth", "latency"},
                          "inter_node: {bandwidth: 50GB/s, latency: 5us}")
    bandwidth = where.get(inter, ("inter_node",), "bandwidth", _parse_rate, 50e9)
    latency = where.get(inter, ("inter_node",), "latency", _parse_seconds, 5e-6)
    if bandwidth <= 0:
        raise where.error(("inter_node", "bandwidth"), "must be > 0, e.g. 50GB/s")
    return Cluster(nodes=nodes, inter_bandwidth=bandwidth, inter_latency=latency, description=str(path))


# ---------------------------------------------------------------------------------------------------
# This machine


def _match_gpu(device_name: str, memory_bytes: int) -> DeviceSpec | None:
    """The catalog entry whose model word is in ``device_name`` and whose memory is within 10%, if any."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    best = None
    for canonical, word in _GPU_WORDS.items():
        spec = CATALOG[canonical]
        off = abs(spec.memory_bytes - memory_bytes) / spec.memory_bytes
        if word in words and off <= _GPU_MEMORY_TOLERANCE and (best is None or off < best[0]):
            best = (off, spec)
    return None if best is None else best[1]


def _gpu_spec(device_name: str, memory_bytes: int) -> DeviceSpec:
    """The spec of a detected GPU: catalog figures with the driver's memory, or guesses if unknown."""
    known = _match_gpu(device_name, memory_bytes)
    if known is not None:
        return replace(known, memory_bytes=memory_bytes)
    return DeviceSpec(
        name=device_name, kind="cuda", memory_bytes=memory_bytes, bandwidth=500e9, flops=100e12,
        source=UNKNOWN_GPU_SOURCE, **_UNKNOWN_DEFAULTS,
    )


def detect_local(calibration: dict | None = None) -> Cluster:
    """This machine as a one-node cluster named after the host.

    With CUDA: one device per GPU, catalog figures matched by name and memory (memory as the driver
    reports it). Without: one CPU worker with the currently available memory and ``cpu_spec(...,
    calibration)``; pass ``read_calibration()`` to use measured figures (None means defaults).
    """
    import torch  # lazy: the rest of this module must not need torch

    host = socket.gethostname()
    if torch.cuda.is_available():
        specs = [
            _gpu_spec(torch.cuda.get_device_name(i), int(torch.cuda.get_device_properties(i).total_memory))
            for i in range(torch.cuda.device_count())
        ]
        node = _make_node(0, host, specs, os.cpu_count())
    else:
        spec = cpu_spec(int(psutil.virtual_memory().available), calibration)
        node = _make_node(0, host, [spec], _cpu_cores(calibration))
    return Cluster(nodes=(node,), description=f"detected on {host}")


NO_CUDA = ("--device cuda was asked for, but torch sees no CUDA device (torch.cuda.is_available() is False: a CPU "
           "build of torch, or no driver); use --device cpu, or run where a GPU and a CUDA build of torch are installed")


def local_cluster(device: str, world: int, calibration: dict | None = None) -> Cluster:
    """`world` rank slots on this machine, one device each, as a run starts them.

    ``cpu``: `world` CPU workers sharing the available memory and the cores evenly. ``cuda``: rank r
    on GPU r mod the GPUs; when ranks outnumber the GPUs each slot gets its share of its GPU's memory
    (addresses stay one per rank: the runtime deals the slots round-robin onto the GPUs). Imports
    torch only for ``cuda``.
    """
    if device == "cpu":
        spec = cpu_spec(max(MiB, int(psutil.virtual_memory().available) // world), calibration)
        node = _make_node(0, socket.gethostname(), [spec] * world, _cpu_cores(calibration))
        return Cluster(nodes=(node,), description=f"{world}x{spec.name}")
    import torch  # lazy: CPU runs never import it in the driver

    gpus = torch.cuda.device_count()
    if gpus < 1:
        raise HardwareError(NO_CUDA)
    specs = [_gpu_spec(torch.cuda.get_device_name(i), int(torch.cuda.get_device_properties(i).total_memory))
             for i in range(gpus)]
    share = -(-world // gpus)
    slots = [replace(specs[r % gpus], memory_bytes=specs[r % gpus].memory_bytes // share) for r in range(world)]
    node = _make_node(0, socket.gethostname(), slots, os.cpu_count())
    return Cluster(nodes=(node,), description=f"{world} rank(s) on {gpus} GPU(s) of {socket.gethostname()}")
