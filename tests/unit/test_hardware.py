"""Device descriptions: the shorthand, cluster YAML files, calibration, and detection of this machine."""

from __future__ import annotations

import json
import os
import socket
import textwrap
from types import SimpleNamespace

import pytest

from shardlm import hardware
from shardlm.hardware import (
    CATALOG,
    CUDA_LAYER_OVERHEAD_S,
    GiB,
    Cluster,
    Device,
    HardwareError,
    Node,
    cpu_spec,
    detect_local,
    load_cluster,
    lookup,
    parse_devices,
    parse_size,
    read_calibration,
)

MiB = 2**20
CALIBRATION = {
    "date": "2025-01-02",
    "cpu": {"bandwidth": 26e9, "flops": 80e9, "layer_overhead_s": 120e-6, "runtime_bytes": 400 * MiB,
            "collective_latency_s": 30e-6, "cores": 7},
}


@pytest.fixture(autouse=True)
def shardlm_home(tmp_path, monkeypatch):
    """Every test gets an empty $SHARDLM_HOME, so a real calibration file never leaks in."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("SHARDLM_HOME", str(home))
    return home


# ---------------------------------------------------------------------------------------------------
# Shorthand


@pytest.mark.parametrize(
    "text, per_node, name, last",
    [
        ("8xH100-80GB", [8], "H100-80GB", "0:7"),
        ("2x8xH100-80GB", [8, 8], "H100-80GB", "1:7"),
        ("H100-80GB", [1], "H100-80GB", "0:0"),
        ("2xcpu-4GB", [2], "cpu-4GB", "0:1"),
        (" 2 X 8 × h100 ", [8, 8], "H100-80GB", "1:7"),
        ("4 x a100-40gb", [4], "A100-40GB", "0:3"),
        ("1xRTX4090-24GB,1xA6000-48GB", [2], "RTX4090-24GB", "0:1"),
        ("1xT4,2x4xL4", [1, 4, 4], "T4-16GB", "2:3"),
        ("2x4xL4, 1xT4, 1xA10", [4, 4, 2], "L4-24GB", "2:1"),
    ],
)
def test_shorthand_shapes(text, per_node, name, last):
    cluster = parse_devices(text)
    assert [len(n.devices) for n in cluster.nodes] == per_node
    assert cluster.devices[0].spec.name == name
    assert cluster.devices[-1].address == last
    assert len(cluster.devices) == sum(per_node)
    assert cluster.description == text.strip()


def test_shorthand_memory_and_node_flags():
    h100 = parse_devices("2x8xH100-80GB")
    assert all(d.spec.memory_bytes == 81559 * MiB for d in h100.devices)
    assert [d.node for d in h100.devices] == [0] * 8 + [1] * 8  # node-major
    assert all(not n.shared_memory_bus and n.cores is None for n in h100.nodes)
    assert (h100.inter_bandwidth, h100.inter_latency) == (50e9, 5e-6)

    cpu = parse_devices("2xcpu-4GB")
    assert [d.spec.memory_bytes for d in cpu.devices] == [4 * GiB, 4 * GiB]
    assert cpu.nodes[0].shared_memory_bus and cpu.nodes[0].cores == os.cpu_count()
    assert cpu.devices[0].spec.kind == "cpu" and cpu.devices[0].spec.source.startswith("default")


def test_comma_joins_one_node_and_node_counts_append():
    both = parse_devices("1xRTX4090-24GB,1xA6000-48GB")
    assert len(both.nodes) == 1
    assert [d.spec.name for d in both.devices] == ["RTX4090-24GB", "A6000-48GB"]
    assert [d.spec.memory_bytes for d in both.devices] == [24564 * MiB, 49140 * MiB]
    mixed = parse_devices("1xT4,2x4xL4,1xA10")
    assert [[d.spec.name for d in n.devices] for n in mixed.nodes] == [["T4-16GB", "A10-24GB"], ["L4-24GB"] * 4,
                                                                        ["L4-24GB"] * 4]


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("", ["no devices given", "8xH100-80GB"]),
        ("   ", ["no devices given"]),
        ("0xH100-80GB", ["bad count '0'", "whole numbers >= 1"]),
        ("2.5xH100-80GB", ["bad count '2.5'", "2x8xH100-80GB"]),
        ("2x0xH100", ["bad count '0'"]),
        ("2xH100,", ["empty group", "stray comma"]),
        ("8x", ["no device name in '8x'"]),
        ("2x2x2xH100", ["too many counts", "M x N x NAME"]),
        ("8xH10", ["unknown device 'H10'", "did you mean H100-80GB", "cluster YAML", "memory, bandwidth and flops"]),
        ("4xRTX4080", ["unknown device 'RTX4080'", "RTX4090-24GB"]),
        ("2xcpu", ["'2xcpu'", "give the memory per worker, e.g. 2xcpu-4GB"]),
        ("cpu-0GB", ["memory > 0", "2xcpu-4GB"]),
        ("cpu-4QB", ["unknown unit 'QB'"]),
        ("1xcpu-4GB,1xH100-80GB", ["mixes cpu workers and cuda devices", "not supported"]),
    ],
)
def test_shorthand_errors(text, fragments):
    with pytest.raises(HardwareError) as err:
        parse_devices(text)
    for fragment in fragments:
        assert fragment in str(err.value)


# ---------------------------------------------------------------------------------------------------
# Catalog


@pytest.mark.parametrize(
    "name, canonical",
    [("H100", "H100-80GB"), ("h100-80gb", "H100-80GB"), ("H200", "H200-141GB"), ("L40S", "L40S-48GB"),
     ("A6000", "A6000-48GB"), ("rtx4090", "RTX4090-24GB"), ("RTX3090", "RTX3090-24GB"), ("L4", "L4-24GB"),
     ("A10", "A10-24GB"), ("t4", "T4-16GB"), (" A100-80GB ", "A100-80GB"), ("A100-40GB", "A100-40GB")],
)
def test_lookup_names_and_aliases(name, canonical):
    assert lookup(name) is CATALOG[canonical]


def test_lookup_unknown_and_ambiguous():
    with pytest.raises(HardwareError, match="did you mean A100-80GB or A100-40GB"):
        lookup("A100")  # two memory sizes: no alias on purpose
    with pytest.raises(HardwareError, match="CPU workers are written with their memory"):
        lookup("cpu")


def test_catalog_figures():
    assert all(s.kind == "cuda" and s.source == "datasheet" for s in CATALOG.values())
    assert all(s.layer_overhead_s == CUDA_LAYER_OVERHEAD_S and s.runtime_bytes == GiB for s in CATALOG.values())
    h100 = CATALOG["H100-80GB"]
    assert (h100.bandwidth, h100.flops, h100.link_bandwidth, h100.link_latency) == (3.35e12, 989e12, 450e9, 2e-6)
    assert CATALOG["T4-16GB"].link_bandwidth == 12e9
    with pytest.raises(AttributeError):
        h100.memory_bytes = 1  # frozen


# ---------------------------------------------------------------------------------------------------
# Sizes, CPU specs, calibration


@pytest.mark.parametrize(
    "text, expected",
    [("4GB", 4 * GiB), ("4GiB", 4 * GiB), ("4gb", 4 * GiB), ("300MB", 300 * MiB), ("1.5TB", 3 * 2**39),
     ("512", 512), ("512B", 512), ("2K", 2048), (" 8 G ", 8 * GiB), ("0.5GB", GiB // 2), (1024, 1024),
     ("1e3", 1000)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [("lots", "cannot read 'lots'"), ("4QB", "unknown unit 'QB'"), ("-1GB", "negative"), ("", "cannot read"),
     (None, "expected a size"), (True, "expected a size")],
)
def test_parse_size_errors(text, fragment):
    with pytest.raises(HardwareError, match=fragment):
        parse_size(text)


def test_cpu_spec_defaults_and_calibrated():
    spec = cpu_spec(4 * GiB)
    assert (spec.name, spec.kind, spec.memory_bytes) == ("cpu-4GB", "cpu", 4 * GiB)
    assert (spec.bandwidth, spec.flops, spec.layer_overhead_s, spec.link_latency) == (20e9, 50e9, 150e-6, 10e-6)
    assert spec.runtime_bytes == 420 * MiB and spec.link_bandwidth == spec.bandwidth
    assert "shardlm calibrate" in spec.source
    measured = cpu_spec(512 * MiB, CALIBRATION)
    assert measured.name == "cpu-512MB" and measured.source == "calibrated 2025-01-02"
    assert (measured.bandwidth, measured.link_bandwidth, measured.flops) == (26e9, 26e9, 80e9)
    assert (measured.layer_overhead_s, measured.runtime_bytes, measured.link_latency) == (120e-6, 400 * MiB, 30e-6)
    with pytest.raises(HardwareError, match="positive memory budget"):
        cpu_spec(0)


def test_calibration_is_read_for_cpu_shorthand(shardlm_home):
    assert read_calibration() is None
    (shardlm_home / "calibration.json").write_text(json.dumps(CALIBRATION))
    assert read_calibration() == CALIBRATION
    assert read_calibration(shardlm_home) == CALIBRATION
    cluster = parse_devices("2xcpu-4GB")
    assert cluster.devices[0].spec.source == "calibrated 2025-01-02"
    assert cluster.devices[1].spec.bandwidth == 26e9 and cluster.nodes[0].cores == 7


@pytest.mark.parametrize(
    "content, fragment",
    [("{not json", "cannot read calibration"), ("[1, 2]", "'cpu' object"), ('{"date": "x"}', "'cpu' object"),
     ('{"cpu": {"bandwidth": -1}}', "cpu.bandwidth is -1"), ('{"cpu": {"flops": "fast"}}', "cpu.flops is 'fast'"),
     ('{"cpu": {"cores": 2.5}}', "cpu.cores is 2.5")],
)
def test_malformed_calibration(shardlm_home, content, fragment):
    (shardlm_home / "calibration.json").write_text(content)
    with pytest.raises(HardwareError) as err:
        read_calibration()
    assert fragment in str(err.value) and "calibration.json" in str(err.value)
    assert "shardlm calibrate" in str(err.value)
    with pytest.raises(HardwareError):
        parse_devices("1xcpu-1GB")
    assert parse_devices("1xH100").devices[0].spec.name == "H100-80GB"  # cuda shorthands never read it


# ---------------------------------------------------------------------------------------------------
# Cluster YAML

EXAMPLE_YAML = """\
inter_node: {bandwidth: 100GB/s, latency: 3us}        # optional
nodes:
  - name: box-a
    devices:
      - {type: RTX4090-24GB, count: 2}               # catalog device
      - {type: my-accel, count: 1, memory: 40GB, bandwidth: 1.2TB/s, flops: 200TFLOPS, link_bandwidth: 25GB/s, link_latency: 10us}
  - name: box-b
    devices: [{type: cpu, count: 2, memory: 4GB}]
  - name: box-c
    cores: 64
    devices:
      - {type: h100, count: 1, memory: 70GB, layer_overhead: 20us, runtime_memory: 2GB}
"""


def write(tmp_path, text: str):
    """Write a dedented cluster file into tmp_path and return its path."""
    path = tmp_path / "cluster.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_load_cluster_example(tmp_path):
    path = write(tmp_path, EXAMPLE_YAML)
    cluster = load_cluster(path)
    assert [n.name for n in cluster.nodes] == ["box-a", "box-b", "box-c"]
    assert (cluster.inter_bandwidth, cluster.inter_latency) == (100e9, 3e-6)
    assert [d.address for d in cluster.devices] == ["0:0", "0:1", "0:2", "1:0", "1:1", "2:0"]
    accel = cluster.devices[2].spec
    assert (accel.name, accel.kind, accel.memory_bytes, accel.source) == ("my-accel", "cuda", 40 * GiB, "cluster file")
    assert (accel.bandwidth, accel.flops, accel.link_bandwidth, accel.link_latency) == (1.2e12, 200e12, 25e9, 10e-6)
    assert cluster.devices[0].spec is CATALOG["RTX4090-24GB"]
    box_b = cluster.nodes[1]
    assert box_b.shared_memory_bus and box_b.cores == os.cpu_count()
    assert box_b.devices[0].spec.memory_bytes == 4 * GiB and box_b.devices[0].spec.kind == "cpu"
    h100 = cluster.devices[5].spec
    assert (h100.name, h100.memory_bytes, h100.bandwidth) == ("H100-80GB", 70 * GiB, 3.35e12)
    assert h100.source == "cluster file"
    assert (h100.layer_overhead_s, h100.runtime_bytes, cluster.nodes[2].cores) == (20e-6, 2 * GiB, 64)
    assert not cluster.nodes[0].shared_memory_bus and cluster.nodes[0].cores is None
    assert cluster.description == str(path)
    assert cluster.describe() == (
        "1 node x (2 x RTX4090-24GB + 1 x my-accel); 1 node x 2 x cpu-4GB; 1 node x 1 x H100-80GB"
    )


def test_load_cluster_defaults_and_plain_numbers(tmp_path):
    path = write(tmp_path, """\
        nodes:
          - devices:
              - {type: x1, memory: 1073741824, bandwidth: 5.0e+11, flops: 1.0e+14, link_latency: 0.00002}
    """)
    cluster = load_cluster(path)
    spec = cluster.devices[0].spec
    assert cluster.nodes[0].name == "node0" and (cluster.inter_bandwidth, cluster.inter_latency) == (50e9, 5e-6)
    assert (spec.memory_bytes, spec.bandwidth, spec.flops, spec.link_latency) == (GiB, 5e11, 1e14, 2e-5)
    assert (spec.link_bandwidth, spec.layer_overhead_s, spec.runtime_bytes) == (25e9, CUDA_LAYER_OVERHEAD_S, GiB)


BAD_YAML = [
    # (file text, path in the message ("" for the whole file), line, other fragment); messages read
    # "cluster.yaml:LINE: path: problem; fix", as manifests do
    ("nodes:\n  - name: a\n    devices:\n      - {type: H100}\n"
     "      - {type: my-accel, memory: 40GB, flops: 1PFLOPS}\n",
     "nodes[0].devices[1].bandwidth", 5, "memory, bandwidth and flops are required"),
    ("nodes:\n  - devices:\n    - type: cpu\n      count: 2\n",
     "nodes[0].devices[0].memory", 3, "memory: 4GB"),
    ("- a\n- b\n", "", 1, "expected a mapping with `nodes` at the top level, got a list"),
    ("inter_node: {bandwidth: 1GB/s}\nnodes: []\n", "nodes", 2, "expected a list of at least one node, got an empty list"),
    ("inter_node: {bandwidth: 1GB/s}\n", "nodes", 1, "missing; add it at the top level, set to the machines"),
    ("nodes:\n  - devices: [{type: T4, count: 0}]\n", "nodes[0].devices[0].count", 2, "expected an integer >= 1, got 0"),
    ("nodes:\n  - devices:\n    - type: T4\n      count: two\n", "nodes[0].devices[0].count", 4, "got 'two'"),
    ("nodes:\n  - devices:\n    - type: T4\n      memory: lots\n", "nodes[0].devices[0].memory", 4,
     "cannot read 'lots' as a size"),
    ("nodes:\n  - devices:\n    - type: T4\n      memory: 0GB\n", "nodes[0].devices[0].memory", 4, "greater than zero"),
    ("nodes:\n  - devices:\n    - {type: x9, memory: 1GB, bandwidth: 1GB/s, flops: 1TFLOPS, link_latency: 0s}\n",
     "nodes[0].devices[0].link_latency", 3, "greater than zero"),
    ("nodes:\n  - devices:\n    - {type: x9, memory: 1GB, bandwidth: 1GHz, flops: 1TFLOPS}\n",
     "nodes[0].devices[0].bandwidth", 3, "unknown unit 'GHz'"),
    ("nodes:\n  - devices:\n    - {typ: T4}\n", "nodes[0].devices[0].typ", 3, "unknown key (did you mean 'type'?)"),
    ("nodes:\n  - devices:\n    - {count: 2}\n", "nodes[0].devices[0].type", 3,
     "missing; add it under nodes[0].devices[0], set to a catalog name such as H100-80GB"),
    ("nodes:\n  - name: a\n    devices: []\n", "nodes[0].devices", 3, "expected a list of at least one device, got an empty list"),
    ("nodes:\n  - name: a\n", "nodes[0].devices", 2, "missing; add it under nodes[0]"),
    ("nodes:\n  - devices:\n    - {type: T4}\n    - {type: cpu, memory: 1GB}\n", "nodes[0].devices[1]", 4,
     "node of their own"),
    ("nodes:\n  - devices: [{type: T4}]\n    cores: many\n", "nodes[0].cores", 3, "expected an integer >= 1, got 'many'"),
    ("nodes:\n  - devices: [{type: T4}]\ninter_node:\n  latency: soon\n", "inter_node.latency", 4, "a duration"),
    ("nodes:\n  - devices: [{type: T4}]\ninter_node: fast\n", "inter_node", 3, "expected a mapping"),
    ("nodes:\n  - devices: [{type: T4}\n", "", 3, "not valid YAML"),
]


@pytest.mark.parametrize("text, where, line, fragment", BAD_YAML)
def test_load_cluster_errors_name_path_and_line(tmp_path, text, where, line, fragment):
    path = write(tmp_path, text)
    with pytest.raises(HardwareError) as err:
        load_cluster(path)
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: {where}"), message
    assert fragment in message and "\n" not in message


def test_load_cluster_missing_file(tmp_path):
    with pytest.raises(HardwareError, match="not found; fix: check the path"):
        load_cluster(tmp_path / "nope.yaml")


def test_unknown_yaml_device_suggests_catalog_name(tmp_path):
    path = write(tmp_path, "nodes:\n  - devices: [{type: H100-80G, count: 2}]\n")
    with pytest.raises(HardwareError, match="did you mean H100-80GB"):
        load_cluster(path)


# ---------------------------------------------------------------------------------------------------
# This machine


def test_detect_local_on_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cluster = detect_local()
    assert len(cluster.nodes) == 1 and len(cluster.devices) == 1
    node, spec = cluster.nodes[0], cluster.devices[0].spec
    assert node.name == socket.gethostname() and node.shared_memory_bus and node.cores == os.cpu_count()
    assert spec.kind == "cpu" and spec.memory_bytes > 0 and spec.name.startswith("cpu-")
    assert "shardlm calibrate" in spec.source
    assert detect_local(CALIBRATION).devices[0].spec.source == "calibrated 2025-01-02"


def test_detect_local_gpus_from_driver_names(monkeypatch):
    import torch

    gpus = [("NVIDIA H100 80GB HBM3", 81559 * MiB), ("NVIDIA A100-SXM4-40GB", 40960 * MiB),
            ("NVIDIA L4", 23034 * MiB), ("NVIDIA GeForce RTX 4090", 24564 * MiB), ("NVIDIA B200", 180 * GiB),
            ("NVIDIA H100 NVL", 95830 * MiB)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: gpus[i][0])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=gpus[i][1]))
    specs = [d.spec for d in detect_local().devices]
    assert [s.name for s in specs[:4]] == ["H100-80GB", "A100-40GB", "L4-24GB", "RTX4090-24GB"]
    assert [s.memory_bytes for s in specs] == [m for _, m in gpus]
    assert specs[0].bandwidth == 3.35e12 and specs[2].bandwidth == 300e9
    for unknown in specs[4:]:  # B200 is not in the catalog; H100 NVL has 94 GB, too far from 80
        assert unknown.source.startswith("detected (unknown model") and (unknown.bandwidth, unknown.flops) == (
            500e9, 100e12)


# ---------------------------------------------------------------------------------------------------
# Cluster values


@pytest.mark.parametrize(
    "text, expected",
    [("8xH100-80GB", "8 x H100-80GB"), ("2x8xH100-80GB", "2 nodes x 8 x H100-80GB"),
     ("1xRTX4090-24GB,1xA6000-48GB", "1 x RTX4090-24GB + 1 x A6000-48GB"), ("2xcpu-512MB", "2 x cpu-512MB"),
     ("2x1xT4,2x2xL4", "2 nodes x 1 x T4-16GB; 2 nodes x 2 x L4-24GB"),
     ("2x1xT4,1xL4,1xA10", "2 nodes x 1 x T4-16GB; 1 node x (1 x L4-24GB + 1 x A10-24GB)")],
)
def test_describe(text, expected):
    assert parse_devices(text).describe() == expected


def test_cluster_checks_device_positions():
    spec = CATALOG["T4-16GB"]
    node = Node(name="a", devices=(Device(node=0, index=1, spec=spec),))
    with pytest.raises(HardwareError, match=r"build it as Device\(node=0, index=0"):
        Cluster(nodes=(node,))
    with pytest.raises(HardwareError, match="at least one node"):
        Cluster(nodes=())
    with pytest.raises(HardwareError, match="has no devices"):
        Cluster(nodes=(Node(name="a", devices=()),))
    with pytest.raises(HardwareError, match="kind 'tpu'"):
        hardware.DeviceSpec(**{**spec.__dict__, "kind": "tpu"})


def test_host_bandwidth_comes_from_the_catalog_or_the_cluster_file(tmp_path):
    assert CATALOG["H100-80GB"].host_bandwidth == 55e9  # measured: pinned copies on one H100 (PCIe Gen5)
    assert CATALOG["A100-80GB"].host_bandwidth == 25e9 and CATALOG["T4-16GB"].host_bandwidth == 12e9
    path = write(tmp_path, """\
        nodes:
          - devices:
              - {type: H100-80GB, host_bandwidth: 30GB/s}
    """)
    assert load_cluster(path).devices[0].spec.host_bandwidth == 30e9
    with pytest.raises(HardwareError, match="greater than zero"):
        load_cluster(write(tmp_path, """\
            nodes:
              - devices:
                  - {type: H100-80GB, host_bandwidth: 0GB/s}
        """))
