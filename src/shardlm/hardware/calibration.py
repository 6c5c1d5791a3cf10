"""CPU worker processes: their figures from defaults or from ``shardlm calibrate``'s measurements."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shardlm.hardware.specs import CALIBRATION_FILE, CPU_DEFAULTS, DEFAULT_SOURCE, DeviceSpec, HardwareError
from shardlm.hardware.units import short_size
from shardlm.paths import home as shardlm_home



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
        name=f"cpu-{short_size(memory_bytes)}", kind="cpu", memory_bytes=memory_bytes,
        bandwidth=float(figures["bandwidth"]), flops=float(figures["flops"]),
        link_bandwidth=float(figures["bandwidth"]), link_latency=float(figures["collective_latency_s"]),
        layer_overhead_s=float(figures["layer_overhead_s"]), runtime_bytes=int(figures["runtime_bytes"]),
        source=source,
    )


def cpu_cores(calibration: dict | None) -> int | None:
    """Cores of this machine: the calibrated count, else ``os.cpu_count()``."""
    if calibration is not None and calibration["cpu"].get("cores"):
        return int(calibration["cpu"]["cores"])
    return os.cpu_count()
