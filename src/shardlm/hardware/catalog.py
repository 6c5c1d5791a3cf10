"""Known GPUs with their datasheet figures, looked up by name or alias, or matched to a detected GPU."""

from __future__ import annotations

import difflib
import re

from shardlm.hardware.specs import CUDA_LAYER_OVERHEAD_S, CUDA_RUNTIME_BYTES, MiB, DeviceSpec, HardwareError

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


UNKNOWN_DEFAULTS = {  # figures for an accelerator not in the catalog, where nobody gives them
    "link_bandwidth": 25e9, "link_latency": 10e-6, "layer_overhead_s": CUDA_LAYER_OVERHEAD_S,
    "runtime_bytes": CUDA_RUNTIME_BYTES,
}


def match_gpu(device_name: str, memory_bytes: int) -> DeviceSpec | None:
    """The catalog entry whose model word is in ``device_name`` and whose memory is within 10%, if any."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    best = None
    for canonical, word in _GPU_WORDS.items():
        spec = CATALOG[canonical]
        off = abs(spec.memory_bytes - memory_bytes) / spec.memory_bytes
        if word in words and off <= _GPU_MEMORY_TOLERANCE and (best is None or off < best[0]):
            best = (off, spec)
    return None if best is None else best[1]

