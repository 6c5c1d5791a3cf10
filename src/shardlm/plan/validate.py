"""Balance validation before anything starts, and advice when nothing fits."""

from __future__ import annotations

import math

from shardlm.plan.plan import IMBALANCE_LIMIT, Plan
from shardlm.plan.search import HEADROOM, Candidate, Request

GiB = 2**30


def violations(plan: Plan) -> list[str]:
    """Every budget or balance problem of a predicted plan, each with its numbers and the fix."""
    return memory_violations(plan) + balance_violations(plan)


def memory_violations(plan: Plan) -> list[str]:
    """Ranks predicted to need more than their device may give, each with its numbers and the fix."""
    pred = plan.predictions
    out = []
    for r in pred.memory:
        if r.total > r.capacity * HEADROOM:
            out.append(f"rank {r.rank} on {r.device} ({r.device_name}) needs {r.total / GiB:.2f} GiB but may use "
                       f"{HEADROOM:.0%} of {r.capacity / GiB:.2f} GiB (weights {r.weights / GiB:.2f}, KV cache "
                       f"{r.kv_cache / GiB:.2f}, activations {r.activations / GiB:.2f}, overhead "
                       f"{r.overhead / GiB:.2f}); move layers off its stage, raise tp, lower kv_cache.max_batch "
                       "or max_seq_len, or quantize")
    return out


def balance_violations(plan: Plan) -> list[str]:
    """The stage-time imbalance over IMBALANCE_LIMIT, with the times and the fix; [] when balanced."""
    perf, out = plan.predictions.performance, []
    if len(perf.stage_times_s) > 1 and perf.imbalance > IMBALANCE_LIMIT:
        times = ", ".join(f"{t * 1e3:.2f}" for t in perf.stage_times_s)
        slow = max(range(len(perf.stage_times_s)), key=lambda s: perf.stage_times_s[s])
        out.append(f"stage times ({times} ms) are {perf.imbalance:.0%} out of balance (limit {IMBALANCE_LIMIT:.0%}); "
                   f"move layers from stage {slow} to its neighbours, or let `shardlm plan` choose the ranges")
    return out


def no_fit_advice(req: Request, candidates: list[Candidate]) -> str:
    """Why nothing fits and what would: by how much, and int4 / more devices / offload."""
    closest = min(candidates, key=lambda c: c.overflow)
    per_dev = max(d.spec.memory_bytes for d in req.cluster.devices)
    need = sum(r.total for r in closest.plan.predictions.memory)
    tried = {c.plan.quantization for c in candidates}
    tips = []
    if "int4" not in tried:
        tips.append("--quantization int4 (or auto)")
    more = math.ceil(need / (per_dev * HEADROOM))
    if more > len(req.cluster.devices):
        tips.append(f"about {more} devices of {per_dev / GiB:.0f} GiB instead of {len(req.cluster.devices)}")
    tips.append(f"a smaller KV budget (--max-batch {req.kv.max_batch}, --max-seq-len {req.kv.max_seq_len} now)")
    if not req.offload:
        tips.append("--offload, to stream layers from host RAM or disk (slow: every token reads them again)")
    return (f"{req.model.name} fits nowhere on {req.cluster.describe()}: the closest layout "
            f"(tp={closest.plan.layout.tp} pp={closest.plan.layout.pp}, {closest.plan.quantization}) is "
            f"{closest.overflow / GiB:.1f} GiB over on its fullest device ({closest.reason}). To make it fit: "
            + "; ".join(tips))
