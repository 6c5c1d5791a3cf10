"""Writing a Plan as a manifest: fields in schema order, byte counts with a human-size comment, atomically."""

from __future__ import annotations

import re
from dataclasses import replace

import yaml

from shardlm.atomic import atomic_file
from shardlm.manifest.schema import HEADER, SCHEMA_VERSION
from shardlm.plan.plan import DEVICES, DTYPES, EMBEDDINGS, OBJECTIVES, OFFLOAD_TIERS, QUANTIZATIONS, Plan, Predictions

_TAG = "tag:yaml.org,2002:"
_BYTE_KEYS = ("weights", "kv_cache", "activations", "overhead", "offloaded", "total", "capacity")
_SIZE_LINE = re.compile(rf"^(\s+(?:- )?(?:{'|'.join(_BYTE_KEYS)}): (\d+))$")
_PERF_FLOATS = ("prefill_tokens_per_s", "decode_latency_s", "decode_tokens_per_s", "single_stream_tokens_per_s")

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
    "embedding": " | ".join(EMBEDDINGS) + " (int8: the embedding and a head tied to it as int8 codes)",
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
        **({"embedding": plan.embedding} if plan.embedding != "float" else {}),
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
    times = tuple(round6(t) for t in perf.stage_times_s)
    imbalance = replace(perf, stage_times_s=times).imbalance  # from the times as written, so a re-read agrees
    performance = {k: round6(getattr(perf, k)) for k in _PERF_FLOATS}
    performance.update(stage_times_s=_Flow(times), bubble=round6(perf.bubble),
                       micro_batches=perf.micro_batches, imbalance=round6(imbalance),
                       breakdown={k: round6(v) for k, v in perf.breakdown.items()})
    return {"memory": memory, "performance": performance, "assumptions": _Lines(pred.assumptions)}


def round6(x: float) -> float:
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

