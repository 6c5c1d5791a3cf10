"""The deployment manifest: a Plan as hand-editable YAML, and back again, validated.

Writing builds a dict in schema order and dumps it with PyYAML (byte counts exact, each with a human-size
comment). Reading does not build Python objects from the YAML; it composes the node tree and walks it
with the field path in hand, so every error names the file, the line, the field and the fix:

    m.yaml:14: parallelism.tensor: expected an integer >= 1, got 'two'; set it to the tensor-parallel degree, e.g. 2

The schema, field by field, is in docs/manifest.md.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, TypeVar

import yaml

from shardlm.atomic import atomic_file
from shardlm.plan.layout import LayoutError, ParallelLayout, check_ranges
from shardlm.plan.plan import (DEVICES, DTYPES, OBJECTIVES, OFFLOAD_TIERS, QUANTIZATIONS, KVBudget, ModelRef,
                               Monitoring, Offload, Performance, Plan, Predictions, RankMemory, Serving)

SCHEMA_VERSION = 1
HEADER = (f"# shardlm deployment manifest (schema version {SCHEMA_VERSION}); "
          "edit and check with `shardlm validate FILE`")

_T = TypeVar("_T")
_TAG = "tag:yaml.org,2002:"
_DEVICE = re.compile(r"[0-9]+:[0-9]+")
_BYTE_KEYS = ("weights", "kv_cache", "activations", "overhead", "offloaded", "total", "capacity")
_SIZE_LINE = re.compile(rf"^(\s+(?:- )?(?:{'|'.join(_BYTE_KEYS)}): (\d+))$")
_PREDICTIONS_NOTE = "or delete the whole predictions section (`shardlm validate` recomputes it)"

_TOP_KEYS = ("version", "model", "cluster", "device", "dtype", "quantization", "objective", "parallelism", "stages",
             "kv_cache", "offload", "serving", "monitoring", "predictions")
_MEMORY_KEYS = ("rank", "device", "device_name") + _BYTE_KEYS
_PERF_FLOATS = ("prefill_tokens_per_s", "decode_latency_s", "decode_tokens_per_s", "single_stream_tokens_per_s")
_PERF_KEYS = _PERF_FLOATS + ("stage_times_s", "bubble", "micro_batches", "imbalance", "breakdown")

# What each field should hold, as a noun phrase: "set it to <hint>". Paths with [] stand for any index.
_HINTS = {
    "version": f"{SCHEMA_VERSION}",
    "model": "a mapping with at least a name, e.g. {name: llama-3.1-8b}",
    "model.name": "the preset name or model folder the plan is for, e.g. llama-3.1-8b",
    "model.architecture": "the Hugging Face architecture, e.g. LlamaForCausalLM",
    "model.parameters": "the parameter count, e.g. 8030261248",
    "model.layers": "the number of decoder layers, e.g. 32",
    "cluster": "a device shorthand like 8xH100-80GB, a cluster file path, or local",
    "device": "one of " + ", ".join(DEVICES),
    "dtype": "one of " + ", ".join(DTYPES),
    "quantization": "one of " + ", ".join(QUANTIZATIONS),
    "objective": "one of " + ", ".join(OBJECTIVES),
    "parallelism": "a mapping {tensor: T, pipeline: P, data: D}",
    "parallelism.tensor": "the tensor-parallel degree, e.g. 2",
    "parallelism.pipeline": "the number of pipeline stages, e.g. 1",
    "parallelism.data": "the number of data-parallel replicas, e.g. 1",
    "parallelism.micro_batches": "the micro-batches in flight through the stages, e.g. 2 (0: one per stage)",
    "stages": "a list with one entry {layers: [start, stop], devices: [[...]]} per pipeline stage",
    "stages[]": 'a mapping {layers: [start, stop], devices: [["0:0", ...]]}',
    "stages[].layers": "the stage's [start, stop) layer range, e.g. [0, 16]",
    "stages[].layers[]": "a layer number, e.g. 16",
    "stages[].devices": 'one list of device addresses per data-parallel replica, e.g. [["0:0", "0:1"]]',
    "stages[].devices[]": 'the replica\'s tensor-parallel device addresses, e.g. ["0:0", "0:1"]',
    "stages[].devices[][]": 'a device address "node:index", e.g. "0:1"',
    "kv_cache": "a mapping {max_batch: B, max_seq_len: L}",
    "kv_cache.max_batch": "the number of sequences decoded together, e.g. 8",
    "kv_cache.max_seq_len": "the prompt plus generated tokens per sequence, e.g. 4096",
    "kv_cache.prefill_chunk": "the tokens per sequence in one prefill forward, e.g. 2048",
    "offload": "a mapping {tier: none, layers: [], dir: null}",
    "offload.tier": "one of " + ", ".join(OFFLOAD_TIERS),
    "offload.layers": "one count of offloaded layers per stage, e.g. [0, 4]",
    "offload.layers[]": "a count of offloaded layers, e.g. 4",
    "offload.dir": "a folder for disk offload, or null",
    "offload.prefetch": "true or false",
    "offload.vocab": "one true/false per stage, e.g. [false, true]",
    "offload.vocab[]": "true or false",
    "serving": "a mapping {host: 127.0.0.1, port: 8000}",
    "serving.host": "a bind address, e.g. 127.0.0.1",
    "serving.port": "a TCP port in 1..65535, e.g. 8000",
    "monitoring": "a mapping {metrics: true, dashboard: true}",
    "monitoring.metrics": "true or false",
    "monitoring.dashboard": "true or false",
}


class ManifestError(ValueError):
    """A manifest that cannot be read: names the file, line, field path and the fix."""


# ---------------------------------------------------------------------------------------------- writing


class _Dumper(yaml.SafeDumper):
    """SafeDumper that never writes anchors; the marker types below choose how some values are laid out."""

    def ignore_aliases(self, data) -> bool:
        return True


class _Block(dict):
    """A mapping always written in block style (one key per line), even when all its values are scalars."""


class _Lines(list):
    """A list always written one item per line (long strings stay readable)."""


class _Flow(list):
    """A list always written on one line, [a, b]."""


class _Address(str):
    """A device address, always double-quoted: unquoted, YAML 1.1 reads 1:30 as the number 90."""


_Dumper.add_representer(_Block, lambda d, data: d.represent_mapping(f"{_TAG}map", data, flow_style=False))
_Dumper.add_representer(_Lines, lambda d, data: d.represent_sequence(f"{_TAG}seq", data, flow_style=False))
_Dumper.add_representer(_Flow, lambda d, data: d.represent_sequence(f"{_TAG}seq", data, flow_style=True))
_Dumper.add_representer(_Address, lambda d, data: d.represent_scalar(f"{_TAG}str", str(data), style='"'))

# Comments written after top-level keys, for whoever edits the file by hand.
_TOP_COMMENTS = {
    "device": " | ".join(DEVICES),
    "dtype": " | ".join(DTYPES),
    "quantization": " | ".join(QUANTIZATIONS),
    "objective": " | ".join(OBJECTIVES),
    "stages": "one per pipeline stage: layers [start, stop); devices: one list per replica, one address per tp rank",
    "offload": "tier: " + " | ".join(OFFLOAD_TIERS) + "; layers: per stage, how many are offloaded",
    "predictions": "written by the planner; optional (`shardlm validate` recomputes it)",
}


def plan_to_yaml(plan: Plan) -> str:
    """The manifest text of `plan`: a header comment, then the schema-version-1 fields in a fixed order.

    Small sections are written on one line ({tensor: 2, ...}); byte counts are exact integers followed by a
    human-size comment; floats keep 6 significant digits.
    """
    body = yaml.dump(_plan_doc(plan), Dumper=_Dumper, sort_keys=False, default_flow_style=None,
                     width=110, allow_unicode=True)
    return f"{HEADER}\n{_add_comments(body)}"


def _add_comments(body: str) -> str:
    """Append the top-level key comments and a human size to every byte count of 1 KiB or more."""
    lines = []
    for line in body.splitlines():
        key = line.split(":", 1)[0]
        size = _SIZE_LINE.match(line)
        if key in _TOP_COMMENTS:
            line += f"  # {_TOP_COMMENTS[key]}"
        elif size and int(size.group(2)) >= 1024:
            line += f"  # {_human(int(size.group(2)))}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _plan_doc(plan: Plan) -> dict:
    lay, m = plan.layout, plan.model
    doc = {
        "version": SCHEMA_VERSION,
        "model": {"name": m.name, "architecture": m.architecture, "parameters": m.parameters, "layers": m.n_layers},
        "cluster": plan.cluster,
        "device": plan.device,
        "dtype": plan.dtype,
        "quantization": plan.quantization,
        "objective": plan.objective,
        "parallelism": {"tensor": lay.tp, "pipeline": lay.pp, "data": lay.dp,
                        **({"micro_batches": plan.micro_batches} if plan.micro_batches else {})},
        # YAML groups devices by stage (then replica); the layout stores devices[replica][stage].
        "stages": [{"layers": [a, b], "devices": [_Flow(map(_Address, lay.devices[r][s])) for r in range(lay.dp)]}
                   for s, (a, b) in enumerate(lay.stage_layers)],
        "kv_cache": {"max_batch": plan.kv.max_batch, "max_seq_len": plan.kv.max_seq_len,
                     "prefill_chunk": plan.kv.prefill_chunk},
        "offload": {"tier": plan.offload.tier, "layers": list(plan.offload.layers), "dir": plan.offload.dir,
                    "prefetch": plan.offload.prefetch, **({"vocab": list(plan.offload.vocab)} if plan.offload.vocab else {})},
        "serving": {"host": plan.serving.host, "port": plan.serving.port},
        "monitoring": {"metrics": plan.monitoring.metrics, "dashboard": plan.monitoring.dashboard},
    }
    if plan.predictions is not None:
        doc["predictions"] = _predictions_doc(plan.predictions)
    return doc


def _predictions_doc(pred: Predictions) -> dict:
    perf = pred.performance
    memory = [_Block(rank=r.rank, device=_Address(r.device), device_name=r.device_name, weights=r.weights,
                     kv_cache=r.kv_cache, activations=r.activations, overhead=r.overhead,
                     offloaded=r.offloaded, total=r.total, capacity=r.capacity) for r in pred.memory]
    times = tuple(_round(t) for t in perf.stage_times_s)
    imbalance = replace(perf, stage_times_s=times).imbalance  # from the times as written, so a re-read agrees
    performance = {k: _round(getattr(perf, k)) for k in _PERF_FLOATS}
    performance.update(stage_times_s=_Flow(times), bubble=_round(perf.bubble),
                       micro_batches=perf.micro_batches, imbalance=_round(imbalance),
                       breakdown={k: _round(v) for k, v in perf.breakdown.items()})
    return {"memory": memory, "performance": performance, "assumptions": _Lines(pred.assumptions)}


def _round(x: float) -> float:
    """6 significant digits: predictions are estimates, more digits would only be noise."""
    return float(f"{x:.6g}")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def write_manifest(plan: Plan, path) -> None:
    """Write the manifest of `plan` to `path` atomically.

    The text goes to a temporary file in the same folder, is fsynced, and replaces `path` in one rename;
    a crash or an error leaves either the old file or the new one, never a mix, and no temporary behind.
    OSError (missing folder, no permission) propagates unchanged.
    """
    with atomic_file(path) as f:
        f.write(plan_to_yaml(plan))


# ---------------------------------------------------------------------------------------------- reading


def read_manifest(path) -> Plan:
    """Read and validate the manifest at `path`; any problem, including an unreadable file, is a ManifestError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ManifestError(f"{path}: no such manifest file; check the path") from e
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); "
                            "save the manifest as UTF-8") from e
    except OSError as e:
        raise ManifestError(f"{path}: cannot read the manifest ({e.strerror or e}); "
                            "check that it is a readable file") from e
    return parse_manifest(text, source=str(path))


def parse_manifest(text: str, source: str = "<manifest>") -> Plan:
    """Parse and validate manifest text into a Plan; `source` names the file in error messages."""
    root = _compose(text, source)
    top = _mapping(root)
    _check_version(root, top)
    _check_keys(root, top, _TOP_KEYS, ("model", "dtype", "parallelism", "stages", "kv_cache"))
    tp, pp, dp, micro_batches = _parallelism(top["parallelism"])
    layout = _layout(top["stages"], tp, pp, dp)
    offload, serving, monitoring, predictions = (_section(top, k) for k in
                                                 ("offload", "serving", "monitoring", "predictions"))
    return Plan(
        model=_model(top["model"], layout.n_layers),
        cluster=(cluster := _opt(top, "cluster", _str, "local")),
        device=_opt(top, "device", lambda at: _enum(at, DEVICES), device_of_cluster(cluster)),
        dtype=_enum(top["dtype"], DTYPES),
        quantization=_opt(top, "quantization", lambda at: _enum(at, QUANTIZATIONS), "none"),
        layout=layout,
        kv=_kv_cache(top["kv_cache"]),
        objective=_opt(top, "objective", lambda at: _enum(at, OBJECTIVES), "latency"),
        offload=Offload() if offload is None else _offload(offload, layout),
        serving=Serving() if serving is None else _serving(serving),
        monitoring=Monitoring() if monitoring is None else _monitoring(monitoring),
        predictions=None if predictions is None else _predictions(predictions),
        micro_batches=micro_batches,
    )


def device_of_cluster(cluster: str) -> str:
    """The device kind a manifest without `device` runs on: cuda for a GPU shorthand or a cluster file whose
    name does not say cpu, cpu otherwise ("local" included: the run's --device decides there)."""
    return "cuda" if cluster != "local" and "cpu" not in cluster.lower() else "cpu"


@dataclass(frozen=True)
class _At:
    """A node of the composed YAML tree with its field path, file and line (the key's line for a field)."""

    node: yaml.Node
    path: str
    source: str
    line: int

    def child(self, key: str | int, node: yaml.Node | None = None, line: int | None = None) -> _At:
        """The field `key` (a mapping key or a list index) below this one."""
        if isinstance(key, int):
            path = f"{self.path}[{key}]"
        else:
            path = f"{self.path}.{key}" if self.path else key
        node = self.node if node is None else node
        return _At(node, path, self.source, node.start_mark.line + 1 if line is None else line)

    def error(self, problem: str, fix: str) -> ManifestError:
        """An error located at this field: 'file:line: path: problem; fix'."""
        where = f"{self.path}: " if self.path else ""
        if self.path.startswith("predictions"):
            fix += f", {_PREDICTIONS_NOTE}"
        return ManifestError(f"{self.source}:{self.line}: {where}{problem}; {fix}")


def _compose(text: str, source: str) -> _At:
    """The document's root node, which must be a mapping."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        what = ": ".join(filter(None, (e.context, e.problem)))
        raise ManifestError(f"{source}:{mark.line + 1 if mark else 1}: not valid YAML ({what}); "
                            "fix the syntax on this line or the one before: indentation, a missing ':', "
                            "or an unquoted value containing ': ' or ' #'") from e
    except yaml.reader.ReaderError as e:  # a character YAML does not allow
        line = text.count("\n", 0, e.position) + 1
        char = e.character if isinstance(e.character, str) else chr(e.character)
        raise ManifestError(f"{source}:{line}: not valid YAML (character {char!r} is not allowed); "
                            "remove it") from e
    if node is None:
        raise ManifestError(f"{source}:1: the manifest is empty; write the fields of docs/manifest.md, "
                            f"starting with `version: {SCHEMA_VERSION}`")
    at = _At(node, "", source, node.start_mark.line + 1)
    if not isinstance(node, yaml.MappingNode):
        raise at.error(f"expected a mapping of fields at the top level, got {_describe(node)}",
                       "write one `field: value` per line, as in docs/manifest.md")
    return at


def _generic(path: str) -> str:
    return re.sub(r"\[\d+\]", "[]", path)


def _fix(at: _At, verb: str = "set it to") -> str:
    """How to correct the field `at`, from the hint table; anything under predictions may also be deleted."""
    if at.path.startswith("predictions"):
        return "correct it"  # error() adds that the section may be deleted instead
    return f"{verb} {_HINTS.get(_generic(at.path), 'a valid value (see docs/manifest.md)')}"


def _describe(node: yaml.Node) -> str:
    """How a node reads in a message: 'two', 5, true, null, a list, a mapping."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value) if node.tag == f"{_TAG}str" else (node.value or "null")


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == f"{_TAG}null"


def _value(node: yaml.ScalarNode):
    """The Python value of a scalar node, by YAML's own rules (0x10, 1_000, yes/no ...)."""
    return yaml.constructor.SafeConstructor().construct_object(node, deep=True)


# ---------------------------------------------------------------------------------------------- typed fields


def _mapping(at: _At) -> dict[str, _At]:
    """The fields of a mapping node by key, each located at its key's line; rejects duplicate keys."""
    if not isinstance(at.node, yaml.MappingNode):
        raise at.error(f"expected a mapping, got {_describe(at.node)}", _fix(at))
    fields: dict[str, _At] = {}
    for key, value in at.node.value:
        if not (isinstance(key, yaml.ScalarNode) and key.tag == f"{_TAG}str"):
            raise at.child(key.value if isinstance(key, yaml.ScalarNode) else "?", key).error(
                f"keys must be plain names, got {_describe(key)}", "use a field name from docs/manifest.md")
        child = at.child(key.value, value, key.start_mark.line + 1)
        if key.value in fields:
            raise child.error(f"appears twice (first on line {fields[key.value].line})", "keep only one of them")
        fields[key.value] = child
    return fields


def _check_keys(at: _At, fields: dict[str, _At], allowed: tuple[str, ...], required: tuple[str, ...]) -> None:
    """Reject unknown keys (suggesting the closest allowed one) and report the first missing required key."""
    where = f"under {at.path}" if at.path else "at the top level"
    for key, child in fields.items():
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise child.error(f"unknown key{hint}", f"the keys allowed {where} are: {', '.join(allowed)}")
    for key in required:
        if key not in fields:
            missing = at.child(key, line=at.line)
            raise missing.error("missing", _fix(missing, f"add it {where}, set to"))


def _fields(at: _At, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, _At]:
    fields = _mapping(at)
    _check_keys(at, fields, allowed, required)
    return fields


def _opt(fields: dict[str, _At], key: str, read: Callable[[_At], _T], default: _T) -> _T:
    return read(fields[key]) if key in fields else default


def _section(fields: dict[str, _At], key: str) -> _At | None:
    """An optional section; absent or null (`serving:` with nothing below) means the defaults."""
    at = fields.get(key)
    return None if at is None or _is_null(at.node) else at


def _list(at: _At) -> list[_At]:
    if not isinstance(at.node, yaml.SequenceNode):
        raise at.error(f"expected a list, got {_describe(at.node)}", _fix(at))
    return [at.child(i, item) for i, item in enumerate(at.node.value)]


def _int(at: _At, minimum: int = 0, maximum: int | None = None) -> int:
    """An integer in range; bools, floats and quoted numbers are refused."""
    want = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}"
    if not (isinstance(at.node, yaml.ScalarNode) and at.node.tag == f"{_TAG}int"):
        raise at.error(f"expected {want}, got {_describe(at.node)}", _fix(at))
    value = _value(at.node)
    if value < minimum or (maximum is not None and value > maximum):
        raise at.error(f"expected {want}, got {value}", _fix(at))
    return value


def _float(at: _At) -> float:
    """A finite number >= 0; also accepts 1e-3, which YAML 1.1 would read as a string."""
    node = at.node
    value = None
    if isinstance(node, yaml.ScalarNode) and node.tag in (f"{_TAG}int", f"{_TAG}float"):
        value = float(_value(node))
    elif isinstance(node, yaml.ScalarNode) and node.tag == f"{_TAG}str" and node.style is None:
        try:
            value = float(node.value)
        except ValueError:
            pass  # reported below, with the field's location
    if value is None or not math.isfinite(value) or value < 0:
        raise at.error(f"expected a number >= 0, got {_describe(node)}", _fix(at))
    return value


def _str(at: _At) -> str:
    """A string, as written: unquoted numbers keep their text (`name: 7b`, `device: 1:0`)."""
    node = at.node
    if not (isinstance(node, yaml.ScalarNode) and node.tag in (f"{_TAG}str", f"{_TAG}int", f"{_TAG}float")):
        quote = f' (to mean the text, quote it: "{node.value}")' if node.tag == f"{_TAG}bool" else ""
        raise at.error(f"expected a string, got {_describe(node)}", _fix(at) + quote)
    return node.value


def _bool(at: _At) -> bool:
    if not (isinstance(at.node, yaml.ScalarNode) and at.node.tag == f"{_TAG}bool"):
        raise at.error(f"expected true or false, got {_describe(at.node)}", _fix(at))
    return _value(at.node)


def _enum(at: _At, choices: tuple[str, ...]) -> str:
    value = _str(at)
    if value not in choices:
        raise at.error(f"expected one of {', '.join(choices)}, got {value!r}", f"use one of: {', '.join(choices)}")
    return value


def _device(at: _At) -> str:
    value = _str(at)
    if not _DEVICE.fullmatch(value):
        raise at.error(f"expected a device address node:index, got {value!r}",
                       'write it as "NODE:INDEX" in quotes, e.g. "0:3" for device 3 of node 0')
    return value


# ---------------------------------------------------------------------------------------------- sections


def _check_version(root: _At, top: dict[str, _At]) -> None:
    """Checked before anything else: another version may have other fields."""
    fix = f"this shardlm reads schema version {SCHEMA_VERSION}; set `version: {SCHEMA_VERSION}`"
    if "version" not in top:
        raise root.child("version", line=root.line).error("missing", fix)
    at = top["version"]
    is_int = isinstance(at.node, yaml.ScalarNode) and at.node.tag == f"{_TAG}int"
    if not (is_int and _value(at.node) == SCHEMA_VERSION):
        raise at.error(f"unsupported schema version {_describe(at.node)}",
                       fix + " (or read the file with the shardlm that wrote it)")


def _parallelism(at: _At) -> tuple[int, int, int, int]:
    f = _fields(at, ("tensor", "pipeline", "data", "micro_batches"), ("tensor", "pipeline", "data"))
    return _int(f["tensor"], 1), _int(f["pipeline"], 1), _int(f["data"], 1), _opt(f, "micro_batches", _int, 0)


def _layout(at: _At, tp: int, pp: int, dp: int) -> ParallelLayout:
    """Stage ranges and devices; YAML lists devices by stage then replica, the layout by replica then stage."""
    stages = _list(at)
    if len(stages) != pp:
        raise at.error(f"{len(stages)} stage(s) listed but parallelism.pipeline is {pp}",
                       f"list one entry per pipeline stage, or set parallelism.pipeline to {len(stages)}")
    ranges, by_stage, seen = [], [], {}
    for stage in stages:
        f = _fields(stage, ("layers", "devices"), ("layers", "devices"))
        ranges.append(_layer_range(f["layers"]))
        try:
            check_ranges(ranges)  # earlier prefixes passed, so a failure is this stage's
        except LayoutError as e:
            raise ManifestError(f"{stage.source}:{f['layers'].line}: {f['layers'].path}: {e}") from e
        by_stage.append(_stage_devices(f["devices"], tp, dp, seen))
    devices = tuple(tuple(by_stage[s][r] for s in range(pp)) for r in range(dp))
    try:
        return ParallelLayout(tp, pp, dp, tuple(ranges), devices)
    except LayoutError as e:  # the checks above should have caught it; never let it escape unlocated
        raise ManifestError(f"{at.source}:{at.line}: {at.path}: {e}") from e


def _layer_range(at: _At) -> tuple[int, int]:
    items = _list(at)
    if len(items) != 2:
        raise at.error(f"expected [start, stop], got {len(items)} number(s)", _fix(at))
    return _int(items[0], 0), _int(items[1], 0)


def _stage_devices(at: _At, tp: int, dp: int, seen: dict[str, _At]) -> list[tuple[str, ...]]:
    """One tuple of tp addresses per replica; `seen` maps each address used so far to where it was."""
    replicas = _list(at)
    addr_lists = [_list(r) for r in replicas]
    if len(replicas) != dp:
        raise at.error(f"{len(replicas)} replica list(s) but parallelism.data is {dp}",
                       f"give one list of {tp} device address(es) per data-parallel replica")
    out = []
    for replica, addrs in zip(replicas, addr_lists):
        if len(addrs) != tp:
            raise replica.error(f"{len(addrs)} device(s) but parallelism.tensor is {tp}",
                                "list one device address per tensor-parallel rank")
        for a in addrs:
            value = _device(a)
            if value in seen:
                raise a.error(f"device {value!r} is already used by {seen[value].path} (line {seen[value].line})",
                              "give each rank its own device")
            seen[value] = a
        out.append(tuple(a.node.value for a in addrs))
    return out


def _model(at: _At, n_layers: int) -> ModelRef:
    f = _fields(at, ("name", "architecture", "parameters", "layers"), ("name",))
    layers = _opt(f, "layers", lambda a: _int(a, 1), n_layers)
    if layers != n_layers:
        raise f["layers"].error(f"{layers} layers but the stages end at layer {n_layers}",
                                f"make them agree: set model.layers to {n_layers} or end the last stage at {layers}")
    return ModelRef(name=_str(f["name"]), architecture=_opt(f, "architecture", _str, ""),
                    parameters=_opt(f, "parameters", _int, 0), n_layers=layers)


def _kv_cache(at: _At) -> KVBudget:
    f = _fields(at, ("max_batch", "max_seq_len", "prefill_chunk"), ("max_batch", "max_seq_len"))
    max_seq_len = _int(f["max_seq_len"], 1)
    return KVBudget(max_batch=_int(f["max_batch"], 1), max_seq_len=max_seq_len,
                    prefill_chunk=_opt(f, "prefill_chunk", lambda a: _int(a, 1), min(max_seq_len, 2048)))


def _offload(at: _At, layout: ParallelLayout) -> Offload:
    f = _fields(at, ("tier", "layers", "dir", "prefetch", "vocab"))
    tier = _opt(f, "tier", lambda a: _enum(a, OFFLOAD_TIERS), "none")
    items = _list(f["layers"]) if "layers" in f else []
    counts = tuple(_int(i, 0) for i in items)
    where = f.get("layers", at.child("layers", line=at.line))
    if tier == "none" and counts:
        raise where.error("lists offloaded layers but offload.tier is none",
                          f"set offload.tier to {' or '.join(OFFLOAD_TIERS[1:])}, or make offload.layers []")
    if tier != "none" and len(counts) != layout.pp:
        raise where.error(f"{len(counts)} count(s) for {layout.pp} stage(s)",
                          "give one count of offloaded layers per stage, e.g. [" + ", ".join(["0"] * layout.pp) + "]")
    for item, count, (a, b) in zip(items, counts, layout.stage_layers):
        if count > b - a:
            raise item.error(f"{count} offloaded layers but the stage has only {b - a}",
                             f"offload at most {b - a} layers of this stage")
    vocab = tuple(_bool(v) for v in _list(f["vocab"])) if "vocab" in f else ()
    if vocab and (tier != "disk" or len(vocab) != layout.pp):
        raise f["vocab"].error(f"{len(vocab)} flag(s) with offload.tier {tier} and {layout.pp} stage(s)",
                               "give one true/false per stage with offload.tier disk, or delete offload.vocab")
    return Offload(tier=tier, layers=counts, dir=_opt(f, "dir", lambda a: None if _is_null(a.node) else _str(a), None),
                   prefetch=_opt(f, "prefetch", _bool, True), vocab=vocab)


def _serving(at: _At) -> Serving:
    f = _fields(at, ("host", "port"))
    return Serving(host=_opt(f, "host", _str, Serving.host), port=_opt(f, "port", lambda a: _int(a, 1, 65535),
                                                                        Serving.port))


def _monitoring(at: _At) -> Monitoring:
    f = _fields(at, ("metrics", "dashboard"))
    return Monitoring(metrics=_opt(f, "metrics", _bool, True), dashboard=_opt(f, "dashboard", _bool, True))


def _predictions(at: _At) -> Predictions:
    f = _fields(at, ("memory", "performance", "assumptions"), ("memory", "performance"))
    return Predictions(memory=tuple(_rank_memory(m) for m in _list(f["memory"])),
                       performance=_performance(f["performance"]),
                       assumptions=tuple(_str(a) for a in _list(f["assumptions"])) if "assumptions" in f else ())


def _rank_memory(at: _At) -> RankMemory:
    f = _fields(at, _MEMORY_KEYS, tuple(k for k in _MEMORY_KEYS if k not in ("offloaded", "total")))
    n = {k: _int(f[k], 0) for k in _BYTE_KEYS if k in f}
    mem = RankMemory(rank=_int(f["rank"], 0), device=_device(f["device"]), device_name=_str(f["device_name"]),
                     weights=n["weights"], kv_cache=n["kv_cache"], activations=n["activations"],
                     overhead=n["overhead"], capacity=n["capacity"], offloaded=n.get("offloaded", 0))
    if "total" in n and n["total"] != mem.total:  # derived: written for people, checked, not stored
        raise f["total"].error(f"{n['total']} is not weights + kv_cache + activations + overhead = {mem.total}",
                               f"set it to {mem.total} or delete it (it is computed)")
    return mem


def _performance(at: _At) -> Performance:
    f = _fields(at, _PERF_KEYS, _PERF_FLOATS + ("stage_times_s", "bubble", "micro_batches"))
    times = tuple(_float(t) for t in _list(f["stage_times_s"]))
    if not times:
        raise f["stage_times_s"].error("is empty", "give one decode-step time per stage")
    breakdown = {k: _float(v) for k, v in _mapping(f["breakdown"]).items()} if "breakdown" in f else {}
    perf = Performance(**{k: _float(f[k]) for k in _PERF_FLOATS}, stage_times_s=times, bubble=_float(f["bubble"]),
                       micro_batches=_int(f["micro_batches"], 1), breakdown=breakdown)
    if "imbalance" in f:  # derived from stage_times_s; both are rounded, so compare loosely
        given = _float(f["imbalance"])
        if not math.isclose(given, perf.imbalance, rel_tol=1e-4, abs_tol=1e-5):
            raise f["imbalance"].error(f"{given} but stage_times_s give {_round(perf.imbalance)}",
                                       f"set it to {_round(perf.imbalance)} or delete it (it is computed)")
    return perf
