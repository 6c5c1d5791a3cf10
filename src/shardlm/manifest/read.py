"""Reading a manifest into a Plan: the YAML checked against the schema, then the fields checked together.

Every error is one line naming the file, the line, the field path and the fix:

    m.yaml:14: parallelism.tensor: expected an integer >= 1, got 'two'; set it to the tensor-parallel degree, e.g. 2
"""

from __future__ import annotations

import math
from pathlib import Path

from shardlm.manifest.schema import (LIMITS, SCHEMA_VERSION, KVCacheSection, Manifest, ManifestError, ModelSection,
                                     OffloadSection, PerformanceSection, PredictionsSection, RankMemorySection)
from shardlm.manifest.write import round6
from shardlm.plan.layout import LayoutError, ParallelLayout, check_ranges
from shardlm.plan.plan import (OFFLOAD_TIERS, KVBudget, ModelRef, Monitoring, Offload, Performance, Plan, Predictions,
                               RankMemory, Serving)
from shardlm.yamlschema import Document, dotted, hint, load_yaml, validate

_PREDICTIONS_NOTE = "or delete the whole predictions section (`shardlm validate` recomputes it)"


def read_manifest(path) -> Plan:
    """Read and validate the manifest at `path`; any problem, including an unreadable file, is a ManifestError."""
    try:
        size = Path(path).stat().st_size
        if size > 4 * LIMITS.max_chars:  # refused unread (4: the widest UTF-8 character)
            raise ManifestError(f"{path}: {size} bytes, more than a manifest may have ({LIMITS.max_chars} "
                                "characters); check that it is a manifest")
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
    doc = load_yaml(text, source, ManifestError, LIMITS, what="manifest", guide="docs/manifest.md",
                    amend=_predictions_note)
    if not isinstance(doc.data, dict):
        raise doc.error((), f"expected a mapping of fields at the top level, got {doc.describe(())}",
                        "write one `field: value` per line, as in docs/manifest.md")
    _check_version(doc)
    m: Manifest = validate(doc, Manifest)
    layout = _layout(doc, m)
    offload = OffloadSection() if m.offload is None else m.offload
    if m.embedding != "float" and any(offload.vocab):
        raise doc.error(("embedding",), f"{m.embedding} with offload.vocab streaming a stage's vocabulary from disk "
                        "(only a float embedding streams)", "set embedding: float, or offload.vocab false per stage")
    serving = Serving() if m.serving is None else Serving(m.serving.host, m.serving.port)
    monitoring = Monitoring() if m.monitoring is None else Monitoring(m.monitoring.metrics, m.monitoring.dashboard)
    return Plan(
        model=_model(doc, m.model, layout.n_layers),
        cluster=m.cluster,
        device=m.device if m.device is not None else device_of_cluster(m.cluster),
        dtype=m.dtype,
        quantization=m.quantization,
        layout=layout,
        kv=_kv_cache(m.kv_cache),
        objective=m.objective,
        offload=_offload(doc, offload, layout),
        serving=serving,
        monitoring=monitoring,
        predictions=None if m.predictions is None else _predictions(doc, m.predictions),
        micro_batches=m.parallelism.micro_batches,
        embedding=m.embedding,
    )


def device_of_cluster(cluster: str) -> str:
    """The device kind a manifest without `device` runs on: cuda for a GPU shorthand or a cluster file whose
    name does not say cpu, cpu otherwise ("local" included: the run's --device decides there)."""
    return "cuda" if cluster != "local" and "cpu" not in cluster.lower() else "cpu"


def _predictions_note(path: tuple, fix: str) -> str:
    """Anything under predictions may also be fixed by deleting the section."""
    return f"{fix}, {_PREDICTIONS_NOTE}" if path and path[0] == "predictions" else fix


def _located(doc: Document, path: tuple, e: Exception) -> ManifestError:
    """A LayoutError ("problem; fix") located at `path`."""
    problem, _, fix = str(e).partition("; ")
    return doc.error(path, problem, fix)


def _check_version(doc: Document) -> None:
    """Checked before anything else: another version may have other fields."""
    fix = f"this shardlm reads schema version {SCHEMA_VERSION}; set `version: {SCHEMA_VERSION}`"
    if "version" not in doc.data:
        raise doc.error(("version",), "missing", fix)
    spot = doc.spots[("version",)]
    if not (spot.plain and spot.text == str(SCHEMA_VERSION)):
        raise doc.error(("version",), f"unsupported schema version {doc.describe(('version',))}",
                        fix + " (or read the file with the shardlm that wrote it)")


def _layout(doc: Document, m: Manifest) -> ParallelLayout:
    """Stage ranges and devices; YAML lists devices by stage then replica, the layout by replica then stage."""
    tp, pp, dp = m.parallelism.tensor, m.parallelism.pipeline, m.parallelism.data
    if len(m.stages) != pp:
        raise doc.error(("stages",), f"{len(m.stages)} stage(s) listed but parallelism.pipeline is {pp}",
                        f"list one entry per pipeline stage, or set parallelism.pipeline to {len(m.stages)}")
    ranges, by_stage, seen = [], [], {}
    for s, stage in enumerate(m.stages):
        at = ("stages", s, "layers")
        if len(stage.layers) != 2:
            raise doc.error(at, f"expected [start, stop], got {len(stage.layers)} number(s)",
                            f"set it to {hint(Manifest, at, doc)}")
        ranges.append((stage.layers[0], stage.layers[1]))
        try:
            check_ranges(ranges)  # earlier prefixes passed, so a failure is this stage's
        except LayoutError as e:
            raise _located(doc, at, e) from e
        by_stage.append(_stage_devices(doc, stage.devices, ("stages", s, "devices"), (tp, dp), seen))
    devices = tuple(tuple(by_stage[s][r] for s in range(pp)) for r in range(dp))
    try:
        return ParallelLayout(tp, pp, dp, tuple(ranges), devices)
    except LayoutError as e:  # the checks above should have caught it; never let it escape unlocated
        raise _located(doc, ("stages",), e) from e


def _stage_devices(doc: Document, replicas: list[list[str]], at: tuple, degrees: tuple[int, int],
                   seen: dict[str, tuple]) -> list[tuple[str, ...]]:
    """One tuple of tp addresses per replica; `seen` maps each address used so far to its path."""
    tp, dp = degrees
    if len(replicas) != dp:
        raise doc.error(at, f"{len(replicas)} replica list(s) but parallelism.data is {dp}",
                        f"give one list of {tp} device address(es) per data-parallel replica")
    for r, addresses in enumerate(replicas):
        if len(addresses) != tp:
            raise doc.error(at + (r,), f"{len(addresses)} device(s) but parallelism.tensor is {tp}",
                            "list one device address per tensor-parallel rank")
        for t, address in enumerate(addresses):
            if address in seen:
                first = seen[address]
                raise doc.error(at + (r, t), f"device {address!r} is already used by {dotted(first)} "
                                f"(line {doc.line(first)})", "give each rank its own device")
            seen[address] = at + (r, t)
    return [tuple(addresses) for addresses in replicas]


def _model(doc: Document, m: ModelSection, n_layers: int) -> ModelRef:
    layers = n_layers if m.layers is None else m.layers
    if layers != n_layers:
        raise doc.error(("model", "layers"), f"{layers} layers but the stages end at layer {n_layers}",
                        f"make them agree: set model.layers to {n_layers} or end the last stage at {layers}")
    return ModelRef(name=m.name, architecture=m.architecture, parameters=m.parameters, n_layers=layers)


def _kv_cache(kv: KVCacheSection) -> KVBudget:
    chunk = min(kv.max_seq_len, 2048) if kv.prefill_chunk is None else kv.prefill_chunk
    return KVBudget(max_batch=kv.max_batch, max_seq_len=kv.max_seq_len, prefill_chunk=chunk)


def _offload(doc: Document, o: OffloadSection, layout: ParallelLayout) -> Offload:
    at = ("offload", "layers")
    counts = tuple(o.layers)
    if o.tier == "none" and counts:
        raise doc.error(at, "lists offloaded layers but offload.tier is none",
                        f"set offload.tier to {' or '.join(OFFLOAD_TIERS[1:])}, or make offload.layers []")
    if o.tier != "none" and len(counts) != layout.pp:
        raise doc.error(at, f"{len(counts)} count(s) for {layout.pp} stage(s)",
                        "give one count of offloaded layers per stage, e.g. [" + ", ".join(["0"] * layout.pp) + "]")
    for s, (count, (a, b)) in enumerate(zip(counts, layout.stage_layers)):
        if count > b - a:
            raise doc.error(at + (s,), f"{count} offloaded layers but the stage has only {b - a}",
                            f"offload at most {b - a} layers of this stage")
    if o.vocab and (o.tier != "disk" or len(o.vocab) != layout.pp):
        raise doc.error(("offload", "vocab"), f"{len(o.vocab)} flag(s) with offload.tier {o.tier} and "
                        f"{layout.pp} stage(s)", "give one true/false per stage with offload.tier disk, "
                        "or delete offload.vocab")
    return Offload(tier=o.tier, layers=counts, dir=o.dir, prefetch=o.prefetch, vocab=tuple(o.vocab))


def _predictions(doc: Document, p: PredictionsSection) -> Predictions:
    return Predictions(memory=tuple(_rank_memory(doc, m, ("predictions", "memory", i)) for i, m in enumerate(p.memory)),
                       performance=_performance(doc, p.performance), assumptions=tuple(p.assumptions))


def _rank_memory(doc: Document, m: RankMemorySection, at: tuple) -> RankMemory:
    mem = RankMemory(rank=m.rank, device=m.device, device_name=m.device_name, weights=m.weights,
                     kv_cache=m.kv_cache, activations=m.activations, overhead=m.overhead, capacity=m.capacity,
                     offloaded=m.offloaded)
    if m.total is not None and m.total != mem.total:  # derived: written for people, checked, not stored
        raise doc.error(at + ("total",), f"{m.total} is not weights + kv_cache + activations + overhead = "
                        f"{mem.total}", f"set it to {mem.total} or delete it (it is computed)")
    return mem


def _performance(doc: Document, p: PerformanceSection) -> Performance:
    at = ("predictions", "performance")
    if not p.stage_times_s:
        raise doc.error(at + ("stage_times_s",), "is empty", "give one decode-step time per stage")
    perf = Performance(prefill_tokens_per_s=p.prefill_tokens_per_s, decode_latency_s=p.decode_latency_s,
                       decode_tokens_per_s=p.decode_tokens_per_s, single_stream_tokens_per_s=p.single_stream_tokens_per_s,
                       stage_times_s=tuple(p.stage_times_s), bubble=p.bubble, micro_batches=p.micro_batches,
                       breakdown=dict(p.breakdown))
    if p.imbalance is not None and not math.isclose(p.imbalance, perf.imbalance, rel_tol=1e-4, abs_tol=1e-5):
        raise doc.error(at + ("imbalance",), f"{p.imbalance} but stage_times_s give {round6(perf.imbalance)}",
                        f"set it to {round6(perf.imbalance)} or delete it (it is computed)")  # both rounded: loosely
    return perf
