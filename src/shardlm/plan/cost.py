"""Time per step: weight and KV traffic over memory bandwidth, FLOPs over peak, collectives (alpha-beta),
point-to-point between stages, fixed per-layer overhead, and offload streaming.

All functions return seconds. `Rate` carries what one rank can use of its device, after sharing a
CPU node's memory bus and cores with the other ranks running at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass

BANDWIDTH_EFFICIENCY = {"cuda": 0.8, "cpu": 1.0}
"""Fraction of datasheet memory bandwidth a decode GEMV reaches (cpu figures are measured already)."""
FLOPS_EFFICIENCY = {"cuda": 0.6, "cpu": 1.0}
"""Fraction of peak FLOP/s a prefill GEMM reaches (cpu figures are measured already)."""


@dataclass(frozen=True)
class Rate:
    """What one rank gets of its device while its peers run."""

    bandwidth: float
    """Bytes/s of memory traffic."""
    flops: float
    """FLOP/s."""
    layer_overhead_s: float
    """Fixed seconds per layer per forward (launches / dispatch), repeated per wave when ranks outnumber cores."""


def ring_all_reduce_s(n: int, nbytes: float, alpha: float, bandwidth: float) -> float:
    """Ring all-reduce of `nbytes` over n ranks: 2(n-1) alpha + 2(n-1)/n * S / B."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bandwidth


def all_gather_s(n: int, nbytes: float, alpha: float, bandwidth: float) -> float:
    """Ring all-gather producing `nbytes` on every rank: (n-1) alpha + (n-1)/n * S / B."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / bandwidth


def p2p_s(nbytes: float, alpha: float, bandwidth: float) -> float:
    """One point-to-point send of `nbytes`: alpha + S / B."""
    return alpha + nbytes / bandwidth


@dataclass(frozen=True)
class StageWork:
    """What one rank of a stage does in one forward."""

    weight_bytes: float
    """Weight bytes read (every resident linear weight once)."""
    kv_bytes: float
    """KV-cache bytes read."""
    flops: float
    """Floating-point operations."""
    layers: int
    """Decoder layers run."""
    all_reduces: int
    """All-reduces over the tp group."""
    all_reduce_bytes: float
    """Bytes per all-reduce."""
    gather_bytes: float
    """Bytes of the vocabulary all-gather (last stage), else 0."""
    offload_bytes: float = 0.0
    """Weight bytes streamed in from the offload tier."""


def stage_time(work: StageWork, rate: Rate, tp: int, alpha: float, link_bw: float,
               offload_bw: float | None = None) -> dict[str, float]:
    """Seconds of one forward on one rank, by cause (memory, compute, collectives, overhead, offload).

    Memory traffic and compute overlap (the larger counts); collectives and per-layer overhead add;
    offload streaming overlaps the rest when prefetched (the larger of the two counts).
    """
    memory = (work.weight_bytes + work.kv_bytes) / rate.bandwidth
    compute = work.flops / rate.flops
    coll = work.all_reduces * ring_all_reduce_s(tp, work.all_reduce_bytes, alpha, link_bw) + \
        all_gather_s(tp, work.gather_bytes, alpha, link_bw)
    overhead = work.layers * rate.layer_overhead_s
    body = max(memory, compute)
    stream = work.offload_bytes / offload_bw if offload_bw and work.offload_bytes else 0.0
    total = max(body + coll + overhead, stream)
    return {"memory": memory, "compute": compute, "collectives": coll, "overhead": overhead,
            "offload": stream, "total": total}


def pipeline_step_s(stage_times: list[float], p2p: float, micro_batches: int, decode: bool) -> tuple[float, float]:
    """Seconds for every micro-batch to pass all p stages once, and the idle fraction (bubble).

    `stage_times` are per micro-batch. A prefill pass fills and drains the pipeline: (m + p - 1)
    slots of the slowest stage, idle (p-1)/(m+p-1) (m = 1: the stages simply run in turn).
    In decode, micro-batch i's next token enters stage 0 as soon as it leaves the last stage, so
    with m >= p every stage stays busy: a step is max(m, p) slots, idle 1 - m/max(m, p).
    """
    p, m = len(stage_times), max(1, micro_batches)
    if p == 1:
        return m * stage_times[0], 0.0
    if m == 1:
        total = sum(stage_times) + p * p2p
        return total, (p - 1) / p
    slot = max(stage_times) + p2p
    if decode:
        return max(m, p) * slot, 1 - m / max(m, p)
    return (m + p - 1) * slot, (p - 1) / (m + p - 1)
