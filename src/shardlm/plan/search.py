"""Enumerate layouts (quantization x tp x pp x dp, stage layer ranges), reject what does not fit with
the reason, rank the rest by the objective."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardlm.hardware import Cluster, Device
from shardlm.models.args import ModelArgs
from shardlm.parallel.stages import stages_from_counts
from shardlm.parallel.split import split_sizes
from shardlm.parallel.styles import Style
from shardlm.plan import memory as mem
from shardlm.plan.balance import assign_layers
from shardlm.plan.layout import ParallelLayout
from shardlm.plan.plan import IMBALANCE_LIMIT, QUANTIZATIONS, KVBudget, ModelRef, Offload, Plan
from shardlm.plan.predict import Setting, predict

HEADROOM = 0.95
"""Share of a device's memory a plan may fill; the rest absorbs allocator fragmentation."""


@dataclass(frozen=True)
class Request:
    """What the user asked `shardlm plan` for."""

    model: ModelRef
    """The model."""
    args: ModelArgs
    """Its shape."""
    tp_plan: dict[str, Style]
    """Its family's TP plan."""
    cluster: Cluster
    """The devices."""
    cluster_name: str
    """How the devices were given (shorthand, file, "local")."""
    dtype: str = "bfloat16"
    """Dtype of unquantized tensors."""
    quantization: str = "auto"
    """auto (least lossy that fits) | none | int8 | int4."""
    objective: str = "latency"
    """latency | throughput."""
    kv: KVBudget = KVBudget(1, 4096, 2048)
    """Batch and length to size for."""
    tp: int | None = None
    """Pinned tensor-parallel degree."""
    pp: int | None = None
    """Pinned pipeline degree."""
    layers: tuple[int, ...] | None = None
    """Pinned layers per stage."""
    offload: bool = False
    """May layers be streamed from host RAM or disk when nothing else fits (opt-in: host RAM is not modelled)."""
    micro_batches: int = 0
    """Pipeline micro-batches (0: one per stage, capped by the batch)."""
    embedding: str = "float"
    """float | int8: how the embedding and a head tied to it are held (Plan.embedding)."""


@dataclass(frozen=True)
class Candidate:
    """One layout, feasible or not."""

    plan: Plan
    """The layout with its predictions."""
    feasible: bool
    """Every rank fits its device and stages are within budget."""
    reason: str = ""
    """Why it was rejected."""
    overflow: int = 0
    """Bytes over budget on the worst rank."""


@dataclass(frozen=True)
class TPGroup:
    """tp identical devices on one node: one pipeline stage of one replica."""

    node: int
    """Node index."""
    name: str
    """Device type."""
    addresses: tuple[str, ...]
    """Device addresses."""


def tp_groups(cluster: Cluster, tp: int) -> list[TPGroup]:
    """Split every node's devices of each type into groups of tp (leftovers stay idle)."""
    out = []
    for node in cluster.nodes:
        by_name: dict[str, list[Device]] = {}
        for d in node.devices:
            by_name.setdefault(d.spec.name, []).append(d)
        for name, devs in by_name.items():
            for i in range(len(devs) // tp):
                out.append(TPGroup(devs[0].node, name, tuple(d.address for d in devs[i * tp:(i + 1) * tp])))
    return out


def _budget(spec, runtime_extra: int = 0) -> float:
    return spec.memory_bytes * HEADROOM - spec.runtime_bytes - runtime_extra


def _layer_caps(req: Request, stages: list[TPGroup], devs: dict[str, Device], quant: str, tp: int) -> tuple[list, list, list]:
    """Per stage: most layers it can hold, seconds per layer and fixed seconds (embedding / head)."""
    a, kv = req.args, req.kv
    caps, per_layer, fixed = [], [], []
    for s, g in enumerate(stages):
        spec = devs[g.addresses[0]].spec
        first, last = s == 0, s == len(stages) - 1
        cap, t_layer, t_fixed = 10**9, 0.0, 0.0
        for r in range(tp):
            w = mem.shard_weights(a, req.tp_plan, tp, r, req.dtype, quant, spec.kind, req.embedding)
            kv_layer = mem.kv_bytes(a, tp, r, 1, kv.max_batch, kv.max_seq_len, req.dtype)
            act = mem.activation_bytes(a, tp, r, kv.max_batch, kv.prefill_chunk, kv.prefill_chunk, req.dtype, last)
            room = _budget(spec) - act - mem.stage_weight_bytes(w, 0, first, last)
            cap = min(cap, int(room // (w.layer + kv_layer)))
            t_layer = max(t_layer, w.layer / spec.bandwidth + spec.layer_overhead_s)
            t_fixed = max(t_fixed, (w.head if last else 0) / spec.bandwidth)
        caps.append(cap)
        per_layer.append(t_layer)
        fixed.append(t_fixed)
    return caps, per_layer, fixed


def _layout(req: Request, groups: list[TPGroup], tp: int, pp: int, dp: int, quant: str,
            devs: dict[str, Device]) -> tuple[ParallelLayout | None, str]:
    """Layout for dp replicas x pp stages from `groups`, layers balanced; or None and the reason."""
    chosen = groups[:dp * pp]
    replicas = [chosen[i * pp:(i + 1) * pp] for i in range(dp)]
    if req.layers is not None:
        counts = list(req.layers)
    else:
        caps, per_layer, fixed = _layer_caps(req, replicas[0], devs, quant, tp)
        counts = assign_layers(req.args.n_layers, per_layer, fixed, caps)
        if counts is None:
            return None, (f"the {pp} stage(s) hold at most {sum(max(c, 0) for c in caps)} of "
                          f"{req.args.n_layers} layers within {HEADROOM:.0%} of device memory")
    devices = tuple(tuple(g.addresses for g in rep) for rep in replicas)
    return ParallelLayout(tp, pp, dp, stages_from_counts(counts), devices), ""


def _evaluate(req: Request, layout: ParallelLayout, quant: str, offload: Offload) -> Candidate:
    """Predict a layout and check every rank against its device's budget."""
    st = Setting(req.args, req.tp_plan, req.cluster, req.dtype, quant, req.kv, offload, req.micro_batches,
                 req.embedding)
    pred = predict(st, layout)
    plan = Plan(req.model, req.cluster_name, req.dtype, quant, layout, req.kv, req.objective, offload,
                predictions=pred, device=req.cluster.devices[0].spec.kind, micro_batches=req.micro_batches,
                embedding=req.embedding)
    worst = max(pred.memory, key=lambda r: r.total - r.capacity * HEADROOM)
    over = int(worst.total - worst.capacity * HEADROOM)
    if over > 0:
        gib = 2**30
        return Candidate(plan, False, (
            f"rank {worst.rank} ({worst.device} {worst.device_name}) needs {worst.total / gib:.1f} GiB > "
            f"{HEADROOM:.0%} of {worst.capacity / gib:.1f} GiB (weights {worst.weights / gib:.1f}, KV "
            f"{worst.kv_cache / gib:.1f}, activations {worst.activations / gib:.1f}, overhead "
            f"{worst.overhead / gib:.1f})"), over)
    perf = pred.performance
    if layout.pp > 1 and perf.imbalance > IMBALANCE_LIMIT:
        times = "/".join(f"{t * 1e3:.1f}" for t in perf.stage_times_s)
        return Candidate(plan, False, f"stage times {times} ms are {perf.imbalance:.0%} out of balance "
                                      f"(limit {IMBALANCE_LIMIT:.0%}): memory forces uneven layer counts",
                         overflow=0)
    return Candidate(plan, True)


def _with_offload(req: Request, layout: ParallelLayout, quant: str) -> Candidate | None:
    """A single-stage layout made to fit by streaming some of its layers from host RAM or disk."""
    if not req.offload or layout.pp != 1 or layout.dp != 1:
        return None
    kinds = {d.address: d.spec.kind for d in req.cluster.devices}
    on_cpu = all(kinds[c.device] == "cpu" for c in layout.coords())
    tier = "disk" if on_cpu else "cpu"  # a GPU streams from host RAM; CPU ranks stream from disk
    w = mem.shard_weights(req.args, req.tp_plan, layout.tp, 0, req.dtype, quant, "cpu" if on_cpu else "cuda",
                          req.embedding)
    base = _evaluate(req, layout, quant, Offload())
    n_off = min(req.args.n_layers, math.ceil(base.overflow / max(w.layer, 1)) + 2)
    if n_off >= req.args.n_layers:
        return None
    return _evaluate(req, layout, quant, Offload(tier, (n_off,), None))


def _shapes(req: Request, n_groups: int, homogeneous: bool, tp: int) -> list[tuple[int, int]]:
    """(pp, dp) pairs to try: every pipeline depth the groups allow, the most replicas that fit."""
    out = []
    pps = [req.pp] if req.pp else range(1, min(n_groups, req.args.n_layers) + 1)
    for pp in pps:
        if pp > n_groups or (req.layers is not None and len(req.layers) != pp):
            continue
        out.append((pp, n_groups // pp if homogeneous else 1))
    return out


def enumerate_candidates(req: Request) -> list[Candidate]:
    """Every layout tried, feasible or not."""
    devs = {d.address: d for d in req.cluster.devices}
    homogeneous = len({d.spec.name for d in req.cluster.devices}) == 1
    quants = list(QUANTIZATIONS) if req.quantization == "auto" else [req.quantization]
    per_node = max(len(n.devices) for n in req.cluster.nodes)
    tps = [req.tp] if req.tp else range(1, min(per_node, req.args.n_heads) + 1)
    out = []
    for quant in quants:
        for tp in tps:
            groups = sorted(tp_groups(req.cluster, tp), key=lambda g: (g.node, -devs[g.addresses[0]].spec.memory_bytes))
            for pp, dp in _shapes(req, len(groups), homogeneous, tp):
                out.append(_try(req, groups, tp, pp, dp, quant, devs))
    return out


def _try(req, groups, tp, pp, dp, quant, devs) -> Candidate:
    layout, why = _layout(req, groups, tp, pp, dp, quant, devs)
    if layout is None:
        layout, _ = _layout(replace(req, layers=tuple(split_sizes(req.args.n_layers, pp))), groups, tp, pp, dp, quant, devs)
        cand = _evaluate(req, layout, quant, Offload())
        return _with_offload(req, layout, quant) or replace(cand, feasible=False, reason=why + "; " + cand.reason)
    cand = _evaluate(req, layout, quant, Offload())
    if not cand.feasible:
        return _with_offload(req, layout, quant) or cand
    return cand


def fixed_candidate(req: Request, offload: Offload = Offload()) -> Candidate | None:
    """The one single-replica layout `req` pins (tp, pp and quantization given; layers per stage given, or
    balanced when None), predicted and checked like any candidate; None when the cluster has too few devices
    for it, or no layer assignment fits the devices' memory."""
    devs = {d.address: d for d in req.cluster.devices}
    groups = sorted(tp_groups(req.cluster, req.tp), key=lambda g: (g.node, -devs[g.addresses[0]].spec.memory_bytes))
    if len(groups) < req.pp:
        return None
    layout, _ = _layout(req, groups, req.tp, req.pp, 1, req.quantization, devs)
    return None if layout is None else _evaluate(req, layout, req.quantization, offload)


def rank_key(c: Candidate, objective: str) -> tuple:
    """Sort key, best first: the objective's metric, then the other one, then fewer devices."""
    p = c.plan.predictions.performance
    devices = c.plan.layout.world
    if objective == "throughput":
        return (-p.decode_tokens_per_s, -p.single_stream_tokens_per_s, devices)
    return (-round(p.single_stream_tokens_per_s, 6), -p.decode_tokens_per_s, devices)


def choose(req: Request, candidates: list[Candidate]) -> list[Candidate]:
    """Feasible candidates, best first, from the first level that has any: no offload before offload
    (streaming weights costs far more speed than quantization costs quality), and with quantization
    auto, the least lossy quantization first."""
    feasible = [c for c in candidates if c.feasible]
    if not feasible:  # fall back to layouts that fit but are out of balance (validate will flag them)
        feasible = [c for c in candidates if c.overflow == 0 and "out of balance" in c.reason]
    for offloaded in (False, True):
        for q in QUANTIZATIONS:
            level = [c for c in feasible if c.plan.quantization == q and (c.plan.offload.tier != "none") == offloaded]
            if level:
                return sorted(level, key=lambda c: rank_key(c, req.objective))
    return []
