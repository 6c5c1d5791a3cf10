"""The devices a model runs on: specs, nodes and clusters, from a shorthand, a YAML file or this machine.

A ``DeviceSpec`` holds the few figures the planner needs (memory, memory bandwidth, peak FLOP/s, link
bandwidth and latency, fixed per-layer overhead, runtime memory). They come from a small datasheet
``CATALOG`` for known GPUs, from ``$SHARDLM_HOME/calibration.json`` (written by ``shardlm calibrate``)
for CPU worker processes, or from a cluster YAML file for anything else.

Three ways in:

- ``parse_devices("2x8xH100-80GB")``: a shorthand; ``2xcpu-4GB`` means two CPU worker processes with
  4 GiB each on this machine.
- ``load_cluster("cluster.yaml")``: a file; errors name the file, the line, the field path and the fix.
- ``detect_local()``: the GPUs of this machine, or one CPU worker using the available memory;
  ``local_cluster(device, world)``: a run's rank slots on this machine.

Units: sizes are binary (``GB`` = GiB = 2**30 bytes, as ``nvidia-smi`` and ``free`` print them); rates
and FLOP/s are decimal (``GB/s`` = 1e9 bytes/s, ``TFLOPS`` = 1e12), as datasheets write them.

The package, floor by floor: ``specs`` (the value types and constants), ``units``, ``catalog``,
``calibration`` (CPU workers), ``shorthand``, ``cluster_file`` (YAML, checked by a pydantic schema:
imported on first use, so importing this package costs no pydantic), ``local`` (this machine; imports
torch lazily).
"""

from pathlib import Path

from shardlm.hardware.calibration import cpu_cores, cpu_spec, read_calibration
from shardlm.hardware.catalog import (ALIASES, CATALOG, PCIE_GEN3_HOST, PCIE_GEN4_HOST, PCIE_GEN5_HOST,
                                      UNKNOWN_DEFAULTS, lookup, match_gpu)
from shardlm.hardware.local import NO_CUDA, detect_local, local_cluster
from shardlm.hardware.shorthand import SHORTHAND_EXAMPLE, parse_devices
from shardlm.hardware.specs import (CALIBRATION_FILE, CPU_DEFAULTS, CUDA_EAGER_LAYER_OVERHEAD_S, CUDA_LAYER_OVERHEAD_S,
                                    CUDA_RUNTIME_BYTES, DEFAULT_SOURCE, UNKNOWN_GPU_SOURCE, Cluster, Device, DeviceSpec,
                                    GiB, HardwareError, MiB, Node, make_node)
from shardlm.hardware.units import parse_flops, parse_rate, parse_seconds, parse_size, short_size

__all__ = [
    "ALIASES", "CALIBRATION_FILE", "CATALOG", "CPU_DEFAULTS", "CUDA_EAGER_LAYER_OVERHEAD_S",
    "CUDA_LAYER_OVERHEAD_S", "CUDA_RUNTIME_BYTES", "DEFAULT_SOURCE", "NO_CUDA", "PCIE_GEN3_HOST", "PCIE_GEN4_HOST",
    "PCIE_GEN5_HOST", "SHORTHAND_EXAMPLE", "UNKNOWN_DEFAULTS", "UNKNOWN_GPU_SOURCE",
    "Cluster", "Device", "DeviceSpec", "GiB", "HardwareError", "MiB", "Node", "cpu_cores", "cpu_spec",
    "detect_local", "load_cluster", "local_cluster", "lookup", "make_node", "match_gpu", "parse_devices",
    "parse_flops", "parse_rate", "parse_seconds", "parse_size", "read_calibration", "short_size",
]


def load_cluster(path: str | Path) -> Cluster:
    """A cluster from a YAML file; see ``shardlm.hardware.cluster_file.load_cluster`` for the format.

    Errors are one-line ``HardwareError``s: ``cluster.yaml:5: nodes[0].devices[1].bandwidth: problem; fix``.
    """
    from shardlm.hardware import cluster_file  # pydantic is imported only when a cluster file is read

    return cluster_file.load_cluster(path)
