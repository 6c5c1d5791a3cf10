"""This machine: its GPUs (matched to the catalog by name and memory) or one CPU worker, and run slots on it."""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import psutil

from shardlm.hardware.calibration import cpu_cores, cpu_spec
from shardlm.hardware.catalog import UNKNOWN_DEFAULTS, match_gpu
from shardlm.hardware.specs import UNKNOWN_GPU_SOURCE, MiB, Cluster, DeviceSpec, HardwareError, make_node


def _gpu_spec(device_name: str, memory_bytes: int) -> DeviceSpec:
    """The spec of a detected GPU: catalog figures with the driver's memory, or guesses if unknown."""
    known = match_gpu(device_name, memory_bytes)
    if known is not None:
        return replace(known, memory_bytes=memory_bytes)
    return DeviceSpec(
        name=device_name, kind="cuda", memory_bytes=memory_bytes, bandwidth=500e9, flops=100e12,
        source=UNKNOWN_GPU_SOURCE, **UNKNOWN_DEFAULTS,
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
        node = make_node(0, host, specs, os.cpu_count())
    else:
        spec = cpu_spec(int(psutil.virtual_memory().available), calibration)
        node = make_node(0, host, [spec], cpu_cores(calibration))
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
        node = make_node(0, socket.gethostname(), [spec] * world, cpu_cores(calibration))
        return Cluster(nodes=(node,), description=f"{world}x{spec.name}")
    import torch  # lazy: CPU runs never import it in the driver

    gpus = torch.cuda.device_count()
    if gpus < 1:
        raise HardwareError(NO_CUDA)
    specs = [_gpu_spec(torch.cuda.get_device_name(i), int(torch.cuda.get_device_properties(i).total_memory))
             for i in range(gpus)]
    share = -(-world // gpus)
    slots = [replace(specs[r % gpus], memory_bytes=specs[r % gpus].memory_bytes // share) for r in range(world)]
    node = make_node(0, socket.gethostname(), slots, os.cpu_count())
    return Cluster(nodes=(node,), description=f"{world} rank(s) on {gpus} GPU(s) of {socket.gethostname()}")
