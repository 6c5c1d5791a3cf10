"""Predictions for one layout: memory per rank (memory.py) and speed (cost.py) on a Cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shardlm.hardware import CUDA_EAGER_LAYER_OVERHEAD_S, Cluster, Device
from shardlm.models.args import ModelArgs
from shardlm.parallel.split import HeadSplit
from shardlm.parallel.styles import Style
from shardlm.plan import memory as mem
from shardlm.plan.cost import (BANDWIDTH_EFFICIENCY, FLOPS_EFFICIENCY, Rate, StageWork, p2p_s, pipeline_step_s,
                               stage_time)
from shardlm.plan.layout import ParallelLayout
from shardlm.plan.plan import KVBudget, Offload, Performance, Predictions, RankMemory
from shardlm.plan.streaming import resident_bytes

OFFLOAD_BANDWIDTH = {"disk": 2e9}
"""Bytes/s streamed from an NVMe disk (assumed, not measured). Host RAM streams at each device's
`host_bandwidth` (pinned copies over its PCIe link)."""


def offload_bandwidth(tier: str, dev: Device) -> float | None:
    """Bytes/s at which `dev` streams offloaded layers from `tier` (None: nothing offloaded)."""
    return dev.spec.host_bandwidth if tier == "cpu" else OFFLOAD_BANDWIDTH.get(tier)


@dataclass(frozen=True)
class Setting:
    """Everything a prediction needs besides the layout."""

    args: ModelArgs
    """Model shape."""
    tp_plan: dict[str, Style]
    """The family's tensor-parallel plan (the loader's slicing rules)."""
    cluster: Cluster
    """The devices."""
    dtype: str
    """Storage and compute dtype."""
    quant: str
    """none | int8 | int4."""
    kv: KVBudget
    """Batch and length the cache is sized for."""
    offload: Offload = Offload()
    """Offloaded layers per stage."""
    micro_batches: int = 0
    """Pipeline micro-batches; 0 picks min(max_batch, pp)."""
    embedding: str = "float"
    """float | int8: how the embedding and a head tied to it are held."""


def device_map(cluster: Cluster) -> dict[str, Device]:
    """Address "node:index" -> Device."""
    return {d.address: d for d in cluster.devices}


def predict(st: Setting, layout: ParallelLayout) -> Predictions:
    """Memory per rank and speed for `layout` under `st`."""
    devs = device_map(st.cluster)
    # max_batch counts sequences across all replicas: each replica serves its share.
    st = replace(st, kv=replace(st.kv, max_batch=math.ceil(st.kv.max_batch / layout.dp)))
    missing = sorted({c.device for c in layout.coords()} - set(devs))
    if missing:
        raise ValueError(f"device(s) {', '.join(missing)} are not in the cluster {st.cluster.describe()}; "
                         f"use addresses from 0:0 to {st.cluster.devices[-1].address}")
    kinds = {devs[c.device].spec.kind for c in layout.coords()}
    shards = {(r, k): mem.shard_weights(st.args, st.tp_plan, layout.tp, r, st.dtype, st.quant, k, st.embedding)
              for r in range(layout.tp) for k in kinds}
    memory = tuple(_rank_memory(st, layout, c, shards[c.tp_rank, devs[c.device].spec.kind], devs[c.device])
                   for c in layout.coords())
    m = st.micro_batches or (min(st.kv.max_batch, layout.pp) if layout.pp > 1 else 1)
    perf = _performance(st, layout, shards, devs, m)
    return Predictions(memory, perf, tuple(assumptions(st, layout, devs)))


def _stage_facts(layout: ParallelLayout, stage: int) -> tuple[int, bool, bool]:
    a, b = layout.stage_layers[stage]
    return b - a, stage == 0, stage == layout.pp - 1


def _offloaded(st: Setting, stage: int) -> int:
    return st.offload.stage_layers(stage)


def _rank_memory(st: Setting, layout: ParallelLayout, c, w: mem.ShardWeights, dev: Device) -> RankMemory:
    n, first, last = _stage_facts(layout, c.stage)
    off = _offloaded(st, c.stage)
    weights = resident_bytes(w, n, first, last, off, st.offload.stage_vocab(c.stage),
                             2 if st.offload.prefetch else 1, st.quant != "none")
    kv = mem.kv_bytes(st.args, layout.tp, c.tp_rank, n, st.kv.max_batch, st.kv.max_seq_len, st.dtype)
    act = mem.activation_bytes(st.args, layout.tp, c.tp_rank, st.kv.max_batch, st.kv.prefill_chunk,
                               st.kv.prefill_chunk, st.dtype, last)
    return RankMemory(c.rank, c.device, dev.spec.name, weights, kv, act, dev.spec.runtime_bytes,
                      dev.spec.memory_bytes, off * w.layer_streamed)


def _rate(dev: Device, active: int, cluster: Cluster, eager: bool = False) -> Rate:
    """A rank's share of its device: CPU ranks on one node split its memory bus and cores.

    With more lock-step ranks than cores (tp 3 on 2 cores), the ranks run in `waves` =
    ceil(ranks / cores): at most `cores` of them run at once, sharing the bandwidth, and every
    collective waits for the last wave. So each rank's rate is the bandwidth over min(ranks, cores)
    concurrent ranks, divided again by the waves, and its fixed per-layer cost repeats per wave.
    Measured on 2 cores (bench/plan_honesty.py): tp 3 decodes 1.3x slower than an even split of the
    cores would give, which a share of ranks / cores (1.5x on the fixed cost only) missed by 19-33 %.
    A GPU rank's fixed per-layer cost is the CUDA-graph replay figure, or the eager one when the
    runtime issues the kernels from the host (`eager`: see `graphs_apply`).
    """
    s = dev.spec
    node = cluster.nodes[dev.node]
    shared = node.shared_memory_bus
    waves = -(-active // node.cores) if shared and node.cores and active > node.cores else 1
    share = min(active, node.cores or active) * waves if shared else 1
    overhead = max(s.layer_overhead_s, CUDA_EAGER_LAYER_OVERHEAD_S) if s.kind == "cuda" and eager \
        else s.layer_overhead_s
    return Rate(s.bandwidth * BANDWIDTH_EFFICIENCY.get(s.kind, 1.0) / share,
                s.flops * FLOPS_EFFICIENCY.get(s.kind, 1.0) / share, overhead * waves)


def graphs_apply(st: Setting, layout: ParallelLayout) -> bool:
    """Whether the engine (runtime/serve_step.py, behind `shardlm generate` and `serve`) replays this layout's decode
    steps as CUDA graphs (runtime/slot_graphs.py), so plans predict them at the replay cost: one GPU per model copy
    (no tensor or pipeline parallelism) and no streamed layers. Measured on an H200 (bench/RESULTS.md)."""
    return layout.tp == 1 and layout.pp == 1 and st.offload.tier == "none"


def _active_counts(layout: ParallelLayout, devs: dict[str, Device], m: int) -> dict[tuple[int, int], int]:
    """(node, stage) -> ranks busy on that node at the same time: the stage's own ranks, or every
    rank on the node once micro-batches overlap the stages."""
    per: dict[tuple[int, int], int] = {}
    for c in layout.coords():
        per[devs[c.device].node, c.stage] = per.get((devs[c.device].node, c.stage), 0) + 1
    if m > 1:
        totals: dict[int, int] = {}
        for (node, _), n in per.items():
            totals[node] = totals.get(node, 0) + n
        return {(node, s): totals[node] for node in totals for s in range(layout.pp)}
    return per


def _work(st: Setting, layout: ParallelLayout, stage: int, tp_rank: int, w: mem.ShardWeights, batch: int,
          tokens: int, context: int, kind: str = "cpu") -> StageWork:
    """One forward of `batch` sequences x `tokens` new tokens each, attending to `context` positions, on a `kind`
    device (CPU ranks all-reduce quantized layers' partial sums in float64: shardlm.quant)."""
    a = st.args
    n, first, last = _stage_facts(layout, stage)
    e = mem.DTYPE_BYTES[st.dtype]
    split = HeadSplit(a.n_heads, a.n_kv_heads, layout.tp)
    q0, q1 = split.q_range(tp_rank)
    k0, k1 = split.kv_range(tp_rank)
    t = batch * tokens
    layer_read = w.layer - w.experts + w.experts * _expert_read_fraction(a, t)
    weights = n * layer_read + (w.head if last else 0)
    kv = 2 * n * batch * (k1 - k0) * context * a.head_dim * e if tokens == 1 else 0
    flops = 2 * t * (n * w.layer_params + (w.head_params if last else 0)) + 4 * t * n * (q1 - q0) * a.head_dim * context
    reduces = 2 * n + (1 if first and layout.tp > 1 else 0)  # one after attention, one after the MLP; embedding
    layer_e = 8 if st.quant != "none" and kind == "cpu" else e  # the layers' reduces; the embedding's is in dtype
    reduce_bytes = t * a.dim * (2 * n * layer_e + (reduces - 2 * n) * e) / max(reduces, 1)  # mean per all-reduce
    return StageWork(weights, kv, flops, n, reduces, reduce_bytes, batch * a.vocab_size * 4 if last else 0,
                     _offloaded(st, stage) * w.layer_streamed)


def _expert_read_fraction(a: ModelArgs, tokens: int) -> float:
    """Share of a layer's bytes read when `tokens` tokens are routed: experts untouched are not read."""
    if not a.is_moe:
        return 1.0
    touched = 1 - (1 - a.experts_per_token / a.n_experts) ** tokens  # expected share of experts hit
    return touched


def _stage_times(st, layout, shards, devs, m, batch, tokens, context) -> list[dict[str, float]]:
    """Per stage, the slowest tp rank's time breakdown for one micro-batch."""
    out, active = [], _active_counts(layout, devs, m)
    for s in range(layout.pp):
        worst = None
        for r in range(layout.tp):
            dev = devs[layout.devices[0][s][r]]
            rate = _rate(dev, active.get((dev.node, s), 1), st.cluster, not graphs_apply(st, layout))
            work = _work(st, layout, s, r, shards[r, dev.spec.kind], batch, tokens, context, dev.spec.kind)
            t = stage_time(work, rate, layout.tp, dev.spec.link_latency, dev.spec.link_bandwidth,
                           offload_bandwidth(st.offload.tier, dev))
            worst = t if worst is None or t["total"] > worst["total"] else worst
        out.append(worst)
    return out


def _p2p(st: Setting, layout: ParallelLayout, devs: dict[str, Device], nbytes: float) -> float:
    """Slowest hop between consecutive stages (inter-node hops use the cluster's network)."""
    worst = 0.0
    for s in range(layout.pp - 1):
        a, b = devs[layout.devices[0][s][0]], devs[layout.devices[0][s + 1][0]]
        if a.node != b.node:
            worst = max(worst, p2p_s(nbytes, st.cluster.inter_latency, st.cluster.inter_bandwidth))
        else:
            worst = max(worst, p2p_s(nbytes, a.spec.link_latency, a.spec.link_bandwidth))
    return worst


def _decode(st, layout, shards, devs, batch: int, m: int) -> tuple[float, float, list[dict[str, float]]]:
    """Seconds per decode step for `batch` sequences in m micro-batches, the bubble, and stage breakdowns."""
    mb = math.ceil(batch / m)
    context = max(1, st.kv.max_seq_len // 2)  # the cache is half full on average over a generation
    times = _stage_times(st, layout, shards, devs, m, mb, 1, context)
    hop = _p2p(st, layout, devs, mb * st.args.dim * mem.DTYPE_BYTES[st.dtype])
    step, bubble = pipeline_step_s([t["total"] for t in times], hop, m, decode=True)
    return step, bubble, times


def _performance(st: Setting, layout: ParallelLayout, shards, devs, m: int) -> Performance:
    b = st.kv.max_batch
    step, bubble, times = _decode(st, layout, shards, devs, b, m)
    single, _, _ = _decode(st, layout, shards, devs, 1, 1)
    mb = math.ceil(b / m)
    chunk = st.kv.prefill_chunk
    pre_times = _stage_times(st, layout, shards, devs, m, mb, chunk, chunk)
    hop = _p2p(st, layout, devs, mb * chunk * st.args.dim * mem.DTYPE_BYTES[st.dtype])
    prefill, _ = pipeline_step_s([t["total"] for t in pre_times], hop, m, decode=False)
    keys = ("memory", "compute", "collectives", "overhead", "offload")
    breakdown = {k: sum(t[k] for t in times) for k in keys}
    return Performance(
        prefill_tokens_per_s=layout.dp * b * chunk / prefill,
        decode_latency_s=step,
        decode_tokens_per_s=layout.dp * b / step,
        single_stream_tokens_per_s=1 / single,
        stage_times_s=tuple(t["total"] for t in times),
        bubble=bubble,
        micro_batches=m,
        breakdown=breakdown,
    )


def assumptions(st: Setting, layout: ParallelLayout, devs: dict[str, Device]) -> list[str]:
    """What the numbers take for granted, in words."""
    out = []
    for name, spec in sorted({d.spec.name: d.spec for d in (devs[c.device] for c in layout.coords())}.items()):
        out.append(f"{name}: {spec.memory_bytes / 2**30:.1f} GiB, {spec.bandwidth / 1e9:.0f} GB/s, "
                   f"{spec.flops / 1e12:.1f} TFLOP/s, {spec.layer_overhead_s * 1e6:.0f} us per layer, "
                   f"{spec.runtime_bytes / 2**20:.0f} MiB runtime ({spec.source})")
    kinds = {devs[c.device].spec.kind for c in layout.coords()}
    if "cuda" in kinds:
        mode = ("decode steps replayed as CUDA graphs (one GPU, nothing streamed)" if graphs_apply(st, layout) else
                "kernels issued by the host (no CUDA graphs with tp/pp or streamed layers): at least "
                f"{CUDA_EAGER_LAYER_OVERHEAD_S * 1e6:.0f} us per layer, measured on one H100 machine's host")
        out.append(f"GPU kernels reach {BANDWIDTH_EFFICIENCY['cuda']:.0%} of memory bandwidth in decode and "
                   f"{FLOPS_EFFICIENCY['cuda']:.0%} of peak FLOP/s in prefill; {mode}")
    if "cpu" in kinds:
        out.append("CPU ranks on one machine share its memory bandwidth and cores")
        per_node: dict[int, int] = {}
        for c in layout.coords():
            per_node[devs[c.device].node] = per_node.get(devs[c.device].node, 0) + 1
        for node, ranks in sorted(per_node.items()):
            cores = st.cluster.nodes[node].cores
            if st.cluster.nodes[node].shared_memory_bus and cores and ranks > cores:
                waves = -(-ranks // cores)
                out.append(f"node {node} runs {ranks} ranks on {cores} cores: they take turns in {waves} waves per "
                           f"collective, so each step costs {waves * cores / ranks:.2f}x an even split of the cores "
                           f"(bench/plan_honesty.py checks this on 2 cores); prefer at most {cores} ranks")
    out.append(f"decode reads a KV cache half full on average ({st.kv.max_seq_len // 2} of {st.kv.max_seq_len} "
               f"positions); prefill processes {st.kv.prefill_chunk} tokens per sequence per forward")
    if st.offload.tier != "none":
        rates = sorted({offload_bandwidth(st.offload.tier, devs[c.device]) for c in layout.coords()})
        shown = "/".join(f"{r / 1e9:.0f}" for r in rates)
        out.append(f"offloaded layers stream from {st.offload.tier} at {shown} GB/s with prefetch overlapping compute")
    return out
