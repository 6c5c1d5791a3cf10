"""Cluster files: the devices of several machines described in YAML, checked against a pydantic schema.

    inter_node: {bandwidth: 100GB/s, latency: 3us}        # optional
    nodes:
      - name: box-a
        devices:
          - {type: RTX4090-24GB, count: 2}                 # catalog device
          - {type: my-accel, memory: 40GB, bandwidth: 1.2TB/s, flops: 200TFLOPS}
      - name: box-b
        devices: [{type: cpu, count: 2, memory: 4GB}]     # CPU worker processes

Errors name the file, the line, the field path and the fix, as manifests do:
``cluster.yaml:5: nodes[0].devices[1].bandwidth: cannot read 'fast' as a bandwidth ...; write it like 50GB/s``.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Callable

from pydantic import BeforeValidator, Field, Strict

from shardlm.hardware.calibration import cpu_cores, cpu_spec, read_calibration
from shardlm.hardware.catalog import CATALOG, UNKNOWN_DEFAULTS, lookup
from shardlm.hardware.specs import Cluster, DeviceSpec, HardwareError, Node, make_node
from shardlm.hardware.units import parse_flops, parse_rate, parse_seconds, parse_size
from shardlm.yamlschema import TEXT, Document, Expect, Int, Invalid, Limits, Section, load_yaml, shown, validate

CLUSTER_EXAMPLE = "nodes: [{name: box-a, devices: [{type: RTX4090-24GB, count: 2}]}]"
UNKNOWN_DEVICE_EXAMPLE = "{type: my-accel, count: 1, memory: 40GB, bandwidth: 1.2TB/s, flops: 200TFLOPS}"
LIMITS = Limits(max_chars=256 * 1024, max_depth=12, max_values=50_000)
"""A cluster file of 1,000 nodes with a few device groups each is about 60 KB."""
_GUIDE = "shardlm.hardware.load_cluster's documentation"


def _quantity(parse: Callable[[Any], Any], core: type, what: str, example: str, positive: bool) -> Any:
    """A field holding a quantity with a unit (``40GB``, ``1.2TB/s``, ``5us``) or a plain number."""

    def read(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return value  # the type check below reports it
        if isinstance(value, str) and len(value) > 40:
            raise Invalid(f"cannot read {shown(value)} as {what}", f"write it like {example}")
        try:
            result = parse(value)
        except HardwareError as e:
            problem, _, fix = str(e).partition("; ")
            raise Invalid(problem, fix) from None
        if positive and result <= 0:
            raise Invalid(f"{value!r} must be greater than zero", f"write it like {example}")
        return core(result)

    sign = "> 0" if positive else ">= 0"
    return Annotated[core, BeforeValidator(read), Strict(), Expect(f"{what} {sign} like {example}")]


SIZE = _quantity(parse_size, int, "a size", "40GB", True)
SIZE_OR_ZERO = _quantity(parse_size, int, "a size", "2GB", False)
RATE = _quantity(parse_rate, float, "a bandwidth", "1.2TB/s", True)
FLOPS = _quantity(parse_flops, float, "a compute rate", "200TFLOPS", True)
LATENCY = _quantity(parse_seconds, float, "a duration", "10us", True)
SECONDS = _quantity(parse_seconds, float, "a duration", "20us", False)


class DeviceEntry(Section):
    """One ``devices`` entry: ``count`` devices of one ``type``, figures optional for catalog types."""

    type: TEXT = Field(description="a catalog name such as H100-80GB, cpu (a CPU worker), or your own "
                                   f"accelerator's name with its figures, e.g. {UNKNOWN_DEVICE_EXAMPLE}")
    count: Int(1) = Field(1, description="how many such devices the node has, e.g. 8")
    memory: SIZE | None = Field(None, description="the memory one device offers a rank, e.g. 40GB")
    bandwidth: RATE | None = Field(None, description="the memory bandwidth, e.g. 1.2TB/s")
    flops: FLOPS | None = Field(None, description="the peak dense FLOP/s, e.g. 200TFLOPS")
    link_bandwidth: RATE | None = Field(None, description="the device-to-device bandwidth in the node, e.g. 25GB/s")
    link_latency: LATENCY | None = Field(None, description="the device-to-device latency, e.g. 10us")
    host_bandwidth: RATE | None = Field(None, description="the pinned host-to-device copy rate, e.g. 25GB/s")
    layer_overhead: SECONDS | None = Field(None, description="the fixed time per layer per step, e.g. 20us")
    runtime_memory: SIZE_OR_ZERO | None = Field(None, description="memory a rank uses besides the model, e.g. 2GB")


class NodeEntry(Section):
    """One machine."""

    name: TEXT | None = Field(None, description="the host name or a label, e.g. box-a")
    devices: Annotated[list[DeviceEntry], Expect("a list of at least one device")] = Field(
        min_length=1, description="the node's devices, e.g. devices: [{type: H100-80GB, count: 8}]")
    cores: Int(1) | None = Field(None, description="the node's CPU cores, e.g. 64")


class InterNode(Section):
    """The network between nodes."""

    bandwidth: RATE | None = Field(None, description="the node-to-node bandwidth per device pair, e.g. 50GB/s")
    latency: SECONDS | None = Field(None, description="seconds per message between nodes, e.g. 5us")


class ClusterFile(Section):
    """A cluster file."""

    nodes: Annotated[list[NodeEntry], Expect("a list of at least one node")] = Field(
        min_length=1, description=f"the machines, e.g. {CLUSTER_EXAMPLE}")
    inter_node: InterNode | None = Field(None, description="a mapping {bandwidth: 50GB/s, latency: 5us}")


_SPEC_FIELDS = {"memory": "memory_bytes", "bandwidth": "bandwidth", "flops": "flops",
                "link_bandwidth": "link_bandwidth", "link_latency": "link_latency",
                "host_bandwidth": "host_bandwidth", "layer_overhead": "layer_overhead_s",
                "runtime_memory": "runtime_bytes"}
"""Cluster-file key -> DeviceSpec field."""


def _device(doc: Document, entry: DeviceEntry, path: tuple, calibration: Callable[[], dict | None]) -> DeviceSpec:
    """The spec of one ``devices`` entry: a CPU worker, a catalog device (figures overridable), or described."""
    kind = entry.type.strip()
    given = {f: getattr(entry, k) for k, f in _SPEC_FIELDS.items() if getattr(entry, k) is not None}
    if not kind:
        raise doc.error(path + ("type",), "is empty", "give the device type, e.g. {type: H100-80GB, count: 8}")
    if kind.lower() == "cpu":
        if "memory_bytes" not in given:
            raise doc.error(path + ("memory",), "a cpu worker needs its memory budget",
                            "add it, e.g. {type: cpu, count: 2, memory: 4GB}")
        spec = cpu_spec(given["memory_bytes"], calibration())
        if "bandwidth" in given and "link_bandwidth" not in given:
            given["link_bandwidth"] = given["bandwidth"]  # workers share DRAM
        return replace(spec, **given, source="cluster file") if len(given) > 1 else spec
    try:
        base = lookup(kind)
    except HardwareError:
        base = None
    if base is not None:
        return replace(base, **given, source="cluster file") if given else base
    for key in ("memory", "bandwidth", "flops"):
        if _SPEC_FIELDS[key] not in given:
            close = difflib.get_close_matches(kind.upper(), [k.upper() for k in CATALOG], n=1, cutoff=0.6)
            also = f" (or did you mean {close[0]}?)" if close else ""
            raise doc.error(path + (key,), f"{shown(kind)} is not in the catalog, so memory, bandwidth and flops "
                            f"are required and {key} is missing", f"add them, e.g. {UNKNOWN_DEVICE_EXAMPLE}{also}")
    return DeviceSpec(name=kind, kind="cuda", source="cluster file", **{**UNKNOWN_DEFAULTS, **given})


def _node(doc: Document, entry: NodeEntry, i: int, calibration: Callable[[], dict | None]) -> Node:
    """One ``nodes`` entry -> the Node at position ``i``."""
    specs: list[DeviceSpec] = []
    for j, device in enumerate(entry.devices):
        path = ("nodes", i, "devices", j)
        spec = _device(doc, device, path, calibration)
        if specs and spec.kind != specs[0].kind:
            raise doc.error(path, "mixes cpu workers and cuda devices in one node, which is not supported",
                            "put the cpu workers in a node of their own")
        specs.extend([spec] * device.count)
    cores = entry.cores
    if cores is None and specs[0].kind == "cpu":
        cores = cpu_cores(calibration())
    return make_node(i, entry.name if entry.name is not None else f"node{i}", specs, cores)


def _read(path: Path) -> Document:
    """The file parsed, within LIMITS; a missing or unreadable file is a HardwareError."""
    if not path.is_file():
        raise HardwareError(f"cluster file {path} not found; fix: check the path, or give the devices as a "
                            "shorthand such as 2xH100-80GB")
    try:
        if path.stat().st_size > 4 * LIMITS.max_chars:  # refused without reading it (4: UTF-8's widest)
            raise HardwareError(f"{path}: {path.stat().st_size} bytes, more than a cluster file may have "
                                f"({LIMITS.max_chars} characters); check that it is a cluster file")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise HardwareError(f"cannot read cluster file {path}: {exc}; fix: check that it is a readable "
                            "UTF-8 text file") from exc
    return load_yaml(text, str(path), HardwareError, LIMITS, what="cluster file", guide=_GUIDE)


def load_cluster(path: str | Path) -> Cluster:
    """A cluster from a YAML file: ``nodes`` (each with ``name`` and ``devices``) and optional ``inter_node``.

    Catalog devices need only ``type`` and ``count`` and may override figures (``memory``, ``bandwidth``,
    ``flops``, ``link_bandwidth``, ``link_latency``, ``host_bandwidth``, ``layer_overhead``,
    ``runtime_memory``); other types must give ``memory``, ``bandwidth`` and ``flops``. ``type: cpu``
    needs ``memory`` per worker. Sizes are binary (``4GB`` = 4 GiB), rates decimal (``50GB/s``), plain
    numbers are bytes, bytes/s, FLOP/s or seconds. Errors are one line,
    ``cluster.yaml:5: nodes[0].devices[1].bandwidth: problem; fix``.
    """
    path = Path(path)
    doc = _read(path)
    if not isinstance(doc.data, dict):
        raise doc.error((), f"expected a mapping with `nodes` at the top level, got {doc.describe(())}",
                        f"write it like {CLUSTER_EXAMPLE}")
    data: ClusterFile = validate(doc, ClusterFile)
    calibration = functools.cache(read_calibration)  # read at most once, and only for cpu nodes
    nodes = tuple(_node(doc, entry, i, calibration) for i, entry in enumerate(data.nodes))
    inter = data.inter_node or InterNode()
    return Cluster(nodes=nodes, inter_bandwidth=inter.bandwidth if inter.bandwidth is not None else 50e9,
                   inter_latency=inter.latency if inter.latency is not None else 5e-6, description=str(path))
