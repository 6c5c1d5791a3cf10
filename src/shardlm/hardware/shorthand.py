"""The device shorthand: ``8xH100-80GB``, ``2x8xH100-80GB``, ``1xRTX4090-24GB,1xA6000-48GB``, ``2xcpu-4GB``."""

from __future__ import annotations

import functools
import re
from typing import Callable

from shardlm.hardware.calibration import cpu_cores, cpu_spec, read_calibration
from shardlm.hardware.catalog import lookup
from shardlm.hardware.specs import Cluster, DeviceSpec, HardwareError, make_node
from shardlm.hardware.units import parse_size

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
    cores = cpu_cores(calibration()) if kinds == {"cpu"} else None
    nodes_ = tuple(make_node(i, f"node{i}", specs, cores) for i, (_, specs) in enumerate(layout))
    return Cluster(nodes=nodes_, description=text.strip())

