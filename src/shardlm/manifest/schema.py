"""The manifest's schema (version 1), field by field, as pydantic models; docs/manifest.md says the same for people.

Each field's ``description`` is the hint messages give after "set it to"; the types (``Int``, ``TEXT``,
``ADDRESS`` ...) say what a value may be. What ties fields together (stage count and pipeline degree,
contiguous ranges, devices used once, derived totals) is checked after this, in ``read``.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

from shardlm.plan.plan import DEVICES, DTYPES, EMBEDDINGS, OBJECTIVES, OFFLOAD_TIERS, QUANTIZATIONS
from shardlm.yamlschema import FLAG, NUMBER, TEXT, Expect, Int, Invalid, Limits, Section, choice, shown

SCHEMA_VERSION = 1
HEADER = (f"# shardlm deployment manifest (schema version {SCHEMA_VERSION}); "
          "edit and check with `shardlm validate FILE`")
LIMITS = Limits(max_chars=2**20, max_depth=16, max_values=60_000)
"""What a manifest may hold. A 2,048-rank plan with predictions is 0.63 MB with 50,000 keys and values
(its predictions are most of it); the caps keep refusing a wrong or huge file to well under a second."""
_ADDRESS = re.compile(r"[0-9]{1,9}:[0-9]{1,9}")
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class ManifestError(ValueError):
    """A manifest that cannot be read or used: names the file, line, field path and the fix."""


def _address(value: str) -> str:
    if not _ADDRESS.fullmatch(value):
        raise ValueError("not node:index")
    return value


def _host(value: str) -> str:
    """An IP address, or a host name: dot-separated labels of letters, digits and inner hyphens."""
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value.split(".")
    if len(value) > 253 or not all(_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise ValueError("not an address or a host name")
    return value


def _folder(value: str) -> str:
    """A path that is not an existing file (a folder, or one to be made)."""
    if not value.strip() or "\0" in value:
        raise Invalid("is empty" if not value.strip() else "contains a NUL character",
                      "set it to a folder for disk offload, or null")
    try:
        is_file = Path(value).exists() and not Path(value).is_dir()
    except OSError as e:  # a name too long for the file system, a loop of links
        raise Invalid(f"{shown(value, limit=200)} cannot be a folder ({e.strerror or type(e).__name__})",
                      "set it to a folder for disk offload, or null") from None
    if is_file:
        raise Invalid(f"{shown(value, limit=200)} is an existing file, not a folder",
                      "set it to a folder for disk offload (it is made when missing), or null")
    return value


ADDRESS = Annotated[TEXT, AfterValidator(_address), Expect("a device address node:index", quote=True),
                    Field(description='a device address "node:index" in quotes, e.g. "0:3" for device 3 of node 0')]
HOST = Annotated[TEXT, AfterValidator(_host), Expect("an IP address or a host name", quote=True)]
FOLDER = Annotated[TEXT, AfterValidator(_folder), Expect("a folder", quote=True)]
_REPLICA = Annotated[list[ADDRESS], Field(description='the replica\'s tensor-parallel device addresses, '
                                                      'e.g. ["0:0", "0:1"]')]


class ModelSection(Section):
    """Which model the plan is for."""

    name: TEXT = Field(description="the preset name or model folder the plan is for, e.g. llama-3.1-8b")
    architecture: TEXT = Field("", description="the Hugging Face architecture, e.g. LlamaForCausalLM")
    parameters: Int(0) = Field(0, description="the parameter count, e.g. 8030261248")
    layers: Int(1) | None = Field(None, description="the number of decoder layers, e.g. 32")


class ParallelismSection(Section):
    """Degrees of parallelism."""

    tensor: Int(1) = Field(description="the tensor-parallel degree, e.g. 2")
    pipeline: Int(1) = Field(description="the number of pipeline stages, e.g. 1")
    data: Int(1) = Field(description="the number of data-parallel replicas, e.g. 1")
    micro_batches: Int(0) = Field(0, description="the micro-batches in flight through the stages, e.g. 2 "
                                                 "(0: one per stage)")


class StageSection(Section):
    """One pipeline stage: its layers and, per replica, its devices."""

    layers: list[Annotated[Int(0), Field(description="a layer number, e.g. 16")]] = Field(
        description="the stage's [start, stop) layer range, e.g. [0, 16]")
    devices: list[_REPLICA] = Field(description='one list of device addresses per data-parallel replica, '
                                                'e.g. [["0:0", "0:1"]]')


class KVCacheSection(Section):
    """What the KV cache is sized for."""

    max_batch: Int(1) = Field(description="the number of sequences decoded together, e.g. 8")
    max_seq_len: Int(1) = Field(description="the prompt plus generated tokens per sequence, e.g. 4096")
    prefill_chunk: Int(1) | None = Field(None, description="the tokens per sequence in one prefill forward, e.g. 2048")


class OffloadSection(Section):
    """Weights kept off the compute device."""

    tier: choice(OFFLOAD_TIERS) = Field("none", description="one of " + ", ".join(OFFLOAD_TIERS))
    layers: list[Annotated[Int(0), Field(description="a count of offloaded layers, e.g. 4")]] = Field(
        default_factory=list, description="one count of offloaded layers per stage, e.g. [0, 4]")
    dir: FOLDER | None = Field(None, description="a folder for disk offload, or null")
    prefetch: FLAG = Field(True, description="true or false")
    vocab: list[FLAG] = Field(default_factory=list, description="one true/false per stage, e.g. [false, true]")


class ServingSection(Section):
    """Where `shardlm serve` listens."""

    host: HOST = Field("127.0.0.1", description="a bind address, e.g. 127.0.0.1 (0.0.0.0 for every interface)")
    port: Int(1, 65535) = Field(8000, description="a TCP port in 1..65535, e.g. 8000")


class MonitoringSection(Section):
    """What the monitor exports."""

    metrics: FLAG = Field(True, description="true or false")
    dashboard: FLAG = Field(True, description="true or false")


class RankMemorySection(Section):
    """Predicted bytes on one rank."""

    rank: Int(0)
    device: ADDRESS
    device_name: TEXT
    weights: Int(0)
    kv_cache: Int(0)
    activations: Int(0)
    overhead: Int(0)
    offloaded: Int(0) = 0
    total: Int(0) | None = None
    capacity: Int(0)


class PerformanceSection(Section):
    """Predicted speed."""

    prefill_tokens_per_s: NUMBER
    decode_latency_s: NUMBER
    decode_tokens_per_s: NUMBER
    single_stream_tokens_per_s: NUMBER
    stage_times_s: list[NUMBER]
    bubble: NUMBER
    micro_batches: Int(1)
    imbalance: NUMBER | None = None
    breakdown: dict[str, NUMBER] = Field(default_factory=dict)


class PredictionsSection(Section):
    """What the planner predicts; optional on input."""

    memory: list[RankMemorySection]
    performance: PerformanceSection
    assumptions: list[TEXT] = Field(default_factory=list)


class Manifest(Section):
    """A deployment manifest, schema version 1."""

    version: Int(1) = Field(description=f"{SCHEMA_VERSION}")
    model: ModelSection = Field(description="a mapping with at least a name, e.g. {name: llama-3.1-8b}")
    cluster: TEXT = Field("local", description="a device shorthand like 8xH100-80GB, a cluster file path, or local")
    device: choice(DEVICES) | None = Field(None, description="one of " + ", ".join(DEVICES))
    dtype: choice(DTYPES) = Field(description="one of " + ", ".join(DTYPES))
    quantization: choice(QUANTIZATIONS) = Field("none", description="one of " + ", ".join(QUANTIZATIONS))
    embedding: choice(EMBEDDINGS) = Field("float", description="one of " + ", ".join(EMBEDDINGS))
    objective: choice(OBJECTIVES) = Field("latency", description="one of " + ", ".join(OBJECTIVES))
    parallelism: ParallelismSection = Field(description="a mapping {tensor: T, pipeline: P, data: D}")
    stages: list[Annotated[StageSection, Field(description='a mapping {layers: [start, stop], devices: '
                                                           '[["0:0", ...]]}')]] = Field(
        description="a list with one entry {layers: [start, stop], devices: [[...]]} per pipeline stage")
    kv_cache: KVCacheSection = Field(description="a mapping {max_batch: B, max_seq_len: L}")
    offload: OffloadSection | None = Field(None, description="a mapping {tier: none, layers: [], dir: null}")
    serving: ServingSection | None = Field(None, description="a mapping {host: 127.0.0.1, port: 8000}")
    monitoring: MonitoringSection | None = Field(None, description="a mapping {metrics: true, dashboard: true}")
    predictions: PredictionsSection | None = None
