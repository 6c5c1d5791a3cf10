"""A /metrics page read back into one snapshot: what `shardlm top` draws (and what the dashboard shows).

No torch, no server code: only prometheus_client's text parser, so `top` starts fast and can watch any
shardlm server it can reach.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class RankView:
    """One rank as /metrics describes it."""

    rank: int
    stage: int
    tp_rank: int
    device: str
    memory: dict[str, float] = field(default_factory=dict)
    """kind -> bytes measured."""
    predicted: dict[str, float] = field(default_factory=dict)
    """kind -> bytes the plan predicted."""
    capacity: float | None = None


@dataclass
class Snapshot:
    """Everything `top` shows, from one scrape."""

    ranks: list[RankView]
    links: dict[tuple[int, int], float]
    """(src, dst) -> bytes, over every operation."""
    link_seconds: dict[tuple[int, int], float]
    running: float
    waiting: float
    kv_usage: float
    generated: float
    finished: dict[str, float]
    latency: dict[str, dict[str, float]]
    """metric (ttft, itl, e2e, queue) -> {"p50", "p90", "p99", "count", "mean"} (from the histograms)."""
    stage_seconds: dict[int, tuple[float, float]]
    """stage -> (mean measured step seconds, predicted)."""
    stage_busy: dict[int, tuple[float, bool]]
    """stage -> (mean busy seconds per step, out of balance), with more than one stage."""


HISTOGRAMS = {"ttft": "shardlm_time_to_first_token_seconds", "itl": "shardlm_inter_token_latency_seconds",
              "e2e": "shardlm_e2e_request_latency_seconds", "queue": "shardlm_request_queue_time_seconds"}


def parse(text: str) -> Snapshot:
    """The snapshot of a /metrics page."""
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    return Snapshot(_ranks(samples), *_links(samples), _one(samples, "shardlm_requests_running"),
                    _one(samples, "shardlm_requests_waiting"), _one(samples, "shardlm_kv_cache_usage_ratio"),
                    _one(samples, "shardlm_generation_tokens_total"),
                    {s.labels["finished_reason"]: s.value for s in samples.get("shardlm_request_finished_total", [])},
                    {k: histogram_summary(samples, name) for k, name in HISTOGRAMS.items()}, _stages(samples),
                    _busy(samples))


def _one(samples: dict, name: str) -> float:
    return sum(s.value for s in samples.get(name, []))


def _ranks(samples: dict) -> list[RankView]:
    ranks: dict[int, RankView] = {}

    def view(labels) -> RankView:
        r = int(labels["rank"])
        if r not in ranks:
            ranks[r] = RankView(r, int(labels["stage"]), int(labels["tp_rank"]), labels["device"])
        return ranks[r]

    for s in samples.get("shardlm_rank_memory_bytes", []):
        view(s.labels).memory[s.labels["kind"]] = s.value
    for s in samples.get("shardlm_rank_memory_predicted_bytes", []):
        view(s.labels).predicted[s.labels["kind"]] = s.value
    for s in samples.get("shardlm_rank_memory_capacity_bytes", []):
        view(s.labels).capacity = s.value
    return [ranks[r] for r in sorted(ranks)]


def _links(samples: dict) -> tuple[dict, dict]:
    out: tuple[dict, dict] = ({}, {})
    for k, name in enumerate(("shardlm_link_bytes_total", "shardlm_link_seconds_total")):
        for s in samples.get(name, []):
            key = (int(s.labels["src"]), int(s.labels["dst"]))
            out[k][key] = out[k].get(key, 0.0) + s.value
    return out


def _stages(samples: dict) -> dict[int, tuple[float, float]]:
    sums = {int(s.labels["stage"]): s.value for s in samples.get("shardlm_stage_step_seconds_sum", [])}
    counts = {int(s.labels["stage"]): s.value for s in samples.get("shardlm_stage_step_seconds_count", [])}
    pred = {int(s.labels["stage"]): s.value for s in samples.get("shardlm_stage_step_seconds_predicted", [])}
    return {st: (sums[st] / counts[st] if counts.get(st) else 0.0, pred.get(st, 0.0)) for st in sorted(sums)}


def _busy(samples: dict) -> dict[int, tuple[float, bool]]:
    flags = {int(s.labels["stage"]): s.value > 0 for s in samples.get("shardlm_stage_out_of_balance", [])}
    return {int(s.labels["stage"]): (s.value, flags.get(int(s.labels["stage"]), False))
            for s in samples.get("shardlm_stage_busy_seconds", [])}


def histogram_summary(samples: dict, name: str) -> dict[str, float]:
    """p50, p90, p99 (linear inside the bucket, as Prometheus' histogram_quantile does), count and mean."""
    buckets = sorted(((float(s.labels["le"]), s.value) for s in samples.get(name + "_bucket", [])),
                     key=lambda b: b[0])
    count, total = _one(samples, name + "_count"), _one(samples, name + "_sum")
    out = {"count": count, "mean": total / count if count else 0.0}
    for q in (0.5, 0.9, 0.99):
        out[f"p{round(q * 100)}"] = quantile(q, buckets)
    return out


def quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The q-quantile of cumulative (upper bound, count) buckets; 0 when empty."""
    if not buckets or buckets[-1][1] == 0:
        return 0.0
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for bound, cum in buckets:
        if cum >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(cum - below, 1e-12)
        lower, below = bound, cum
    return lower
