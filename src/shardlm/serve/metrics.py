"""Prometheus metrics of a serving engine (`GET /metrics`, through prometheus_client).

Three sources, none of which stalls decode:
- requests, observed on the scheduler thread as tokens are emitted (`RequestMetrics`): histograms of time
  to first token, inter-token latency, end-to-end latency and queue time with vLLM's meanings and
  buckets, token and finished-request counters;
- the engine's state, read when Prometheus scrapes (`EngineCollector`): requests running and waiting,
  KV-cache usage;
- the ranks' counters, gathered by `RankPoller` every few seconds: each rank sends them after the next step
  (no round trip of its own), and they are rendered to text once per poll (`RankExposition`): memory by kind
  beside the plan's prediction and the device's capacity, traffic per link, step time per stage (a histogram
  each rank keeps, with the plan's predicted stage time beside it), measured balance against the plan's limit,
  the prefetch hit rate of ranks that stream offloaded layers, and the decode steps a one-GPU rank ran ahead.

Names are `shardlm_*` with underscores only, so `promtool check metrics` passes (vLLM's `vllm:` names
do not). Traffic per link (src -> dst): a collective among a tensor-parallel group is counted on each
rank, once per peer, as the bytes it takes from that peer: an all-reduce's whole tensor (the shared-memory
transport reads every peer's buffer), an all-gather's peer part (the gathered bytes / the group size). Its
seconds are the rank's time in that collective, the same on each of its links. A point-to-point transfer
between pipeline stages is counted once, by the sender, on its link to the next stage.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets (vllm/v1/metrics), so dashboards and alerts written for it translate."""


class RequestMetrics:
    """Request histograms and counters, fed by the engine's scheduler (its `observer`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        labels = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        def count(name, doc):
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        self.ttft = hist("shardlm_time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = hist("shardlm_inter_token_latency_seconds", "Between two tokens of one request.", ITL_BUCKETS)
        self.e2e = hist("shardlm_e2e_request_latency_seconds", "Arrival to last token.", REQUEST_BUCKETS)
        self.queue = hist("shardlm_request_queue_time_seconds", "Arrival to admission into a KV-cache slot.",
                          REQUEST_BUCKETS)
        self.prompt_tokens = count("shardlm_prompt_tokens", "Prompt tokens of finished requests.")
        self.prompt_tokens_shared = count("shardlm_prompt_tokens_shared", "Of those, tokens whose keys and values "
                                          "were copied from another request's KV-cache slot instead of computed.")
        self.generation_tokens = count("shardlm_generation_tokens", "Tokens generated.")
        self.finished = Counter("shardlm_request_finished", "Requests finished, by reason (stop, length, "
                                "cancelled, error).", ["model_name", "finished_reason"], registry=registry)
        self.model_name = model_name

    def token(self, req, now: float) -> None:
        """A token of `req` was emitted at `now` (before `req.last_token_at` moves to it)."""
        if req.first_token_at is None:
            self.ttft.observe(now - req.arrival)
            if req.admitted_at is not None:
                self.queue.observe(req.admitted_at - req.arrival)
        elif req.last_token_at is not None:
            self.itl.observe(now - req.last_token_at)
        self.generation_tokens.inc()

    def finish(self, req, reason: str, now: float) -> None:
        """`req` ended with `reason`."""
        self.e2e.observe(now - req.arrival)
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.prompt_tokens_shared.inc(req.shared)
        self.finished.labels(self.model_name, reason).inc()


class RankPoller:
    """Every `interval_s`, every rank's counters (Engine.rank_stats, answered between two steps)."""

    def __init__(self, engine, interval_s: float = 5.0):
        self.engine, self.interval_s = engine, interval_s
        self.latest: list[dict] | None = None
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shardlm-rank-poller", daemon=True)

    def start(self) -> "RankPoller":
        """Poll in the background from now on."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()

    def poll(self) -> None:
        """One poll now (skipped while the engine is not healthy)."""
        if self.engine.health()[0]:
            self.latest, self.at = self.engine.rank_stats(timeout=60), time.time()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a failed engine is reported by /health, not by the poller
                pass


class RankExposition:
    """The ranks' part of /metrics as exposition text, rendered once per rank poll: scrapes between two polls
    (a Prometheus server and a dashboard each scraping) reuse it instead of rebuilding it on the driver,
    whose CPU time is taken from the ranks' on a machine they fill."""

    def __init__(self, engine, poller: RankPoller):
        self.engine, self.poller = engine, poller
        self._text, self._at = b"", None

    def collect(self):
        """prometheus_client's collector protocol: the families of the latest poll."""
        plan = self.engine.plan
        specs = [plan.rank_spec(r) for r in range(plan.world)]
        return rank_families(self.poller.latest, specs, plan)

    def text(self) -> bytes:
        """The latest poll's families in Prometheus text format (empty before the first poll)."""
        from prometheus_client import generate_latest

        latest, at = self.poller.latest, self.poller.at
        if latest is None:
            return b""
        if at != self._at:
            self._text, self._at = generate_latest(self), at
        return self._text


class EngineCollector:
    """Gauges and counters read at scrape time from the engine, the plan and the latest rank poll."""

    def __init__(self, engine, poller: RankPoller, model_name: str):
        self.engine, self.poller, self.model_name = engine, poller, model_name

    def collect(self):
        """prometheus_client's collector protocol (the ranks' part is `RankExposition`, served as cached text)."""
        yield from self._requests()

    def _requests(self):
        st, kv = self.engine.stats(), self.engine.plan.kv
        name = [self.model_name]
        for metric, doc, value in (
                ("shardlm_requests_running", "Requests holding a KV-cache slot.", st.running),
                ("shardlm_requests_waiting", "Requests queued for a slot.", st.waiting),
                ("shardlm_kv_cache_usage_ratio", "Tokens in the KV cache / its capacity (slots x max_seq_len).",
                 self.engine.cached_tokens() / (kv.max_batch * kv.max_seq_len)),
                ("shardlm_kv_cache_slots", "KV-cache slots (sequences decoded together at most).", st.slots)):
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            yield g
        steps = CounterMetricFamily("shardlm_engine_steps", "Engine steps run (a step may decode several tokens a row: serve --decode-run).", labels=["model_name"])
        steps.add_metric(name, st.steps)
        yield steps


def _rank_labels(spec) -> list[str]:
    return [str(spec.rank), str(spec.stage), str(spec.tp_rank), spec.device]


def rank_families(stats: list[dict], specs: list, plan) -> list:
    """Metric families of one rank poll: memory by kind, traffic per link, step time per stage, offloaded layers'
    streaming, decode steps run ahead."""
    return [*_memory(stats, specs, plan), *_links(stats, specs), *_steps(stats, specs, plan), *_offload(stats, specs),
            *_run_ahead(stats, specs)]


def _run_ahead(stats: list[dict], specs: list) -> list:
    """Decode steps a one-GPU rank launched before reading back the step ahead of them (runtime/ahead.py)."""
    labels = ["rank", "stage", "tp_rank", "device"]
    launched = CounterMetricFamily("shardlm_rank_steps_run_ahead", "Greedy decode steps a one-GPU rank launched on "
                                   "its run-ahead path (argmax on the GPU, tokens read back later).", labels=labels)
    overlapped = CounterMetricFamily("shardlm_rank_steps_run_ahead_overlapped", "Of those, steps launched before the "
                                     "step ahead of them had been read back.", labels=labels)
    for s, spec in zip(stats, specs):
        counts = s.get("run_ahead")
        if counts:
            launched.add_metric(_rank_labels(spec), counts["launched"])
            overlapped.add_metric(_rank_labels(spec), counts["overlapped"])
    return [launched, overlapped]


def _offload(stats: list[dict], specs: list) -> list:
    """Weight streaming of ranks that offload layers: bytes read, prefetches ready in time or waited for."""
    labels = ["rank", "stage", "tp_rank", "device"]
    fams = {k: CounterMetricFamily(f"shardlm_offload_{k}", doc, labels=labels) for k, doc in (
        ("read_bytes", "Bytes of offloaded layers read back (disk or host memory)."),
        ("prefetch_hits", "Offloaded layers whose prefetch had finished when the layer ran."),
        ("prefetch_waits", "Offloaded layers the compute had to wait for."),
        ("prefetch_wait_seconds", "Seconds the compute waited for offloaded layers."))}
    ratio = GaugeMetricFamily("shardlm_offload_prefetch_hit_ratio", "Prefetch hits / layers needed so far.",
                              labels=labels)
    for s, spec in zip(stats, specs):
        st = s.get("streaming")
        if not st:
            continue
        lab = _rank_labels(spec)
        for key, stat in (("read_bytes", "bytes_read"), ("prefetch_hits", "prefetch_hits"),
                          ("prefetch_waits", "prefetch_waits"), ("prefetch_wait_seconds", "wait_s")):
            fams[key].add_metric(lab, st[stat])
        if st.get("hit_rate") is not None:
            ratio.add_metric(lab, st["hit_rate"])
    return [*fams.values(), ratio]


def _memory(stats: list[dict], specs: list, plan) -> list:
    labels = ["rank", "stage", "tp_rank", "device"]
    mem = GaugeMetricFamily("shardlm_rank_memory_bytes", "Memory of a rank by kind: weights (resident), "
                            "streamed (offloaded layers, read per step), kv_cache (allocated), kv_cache_used, "
                            "rss (process), peak_rss, gpu_allocated, gpu_reserved.", labels=labels + ["kind"])
    cap = GaugeMetricFamily("shardlm_rank_memory_capacity_bytes", "Memory the plan gives the rank's device.",
                            labels=labels)
    pred = GaugeMetricFamily("shardlm_rank_memory_predicted_bytes", "The plan's prediction, by kind (weights, "
                             "kv_cache, activations, overhead, offloaded).", labels=labels + ["kind"])
    predicted = {m.rank: m for m in (plan.predictions.memory if plan.predictions else ())}
    for s, spec in zip(stats, specs):
        lab = _rank_labels(spec)
        for kind, value in (("weights", s.get("weight_bytes")), ("streamed", s.get("streamed_bytes")),
                            ("kv_cache", s.get("kv_cache_bytes")), ("kv_cache_used", s.get("kv_cache_used_bytes")),
                            ("rss", s.get("rss_bytes")), ("peak_rss", s.get("peak_rss_bytes")),
                            ("gpu_allocated", s.get("gpu_allocated_bytes")),
                            ("gpu_reserved", s.get("gpu_reserved_bytes"))):
            if value is not None:
                mem.add_metric(lab + [kind], value)
        p = predicted.get(spec.rank)
        if p is not None:
            cap.add_metric(lab, p.capacity)
            for kind in ("weights", "kv_cache", "activations", "overhead", "offloaded"):
                pred.add_metric(lab + [kind], getattr(p, kind))
    return [mem, cap, pred]


def _links(stats: list[dict], specs: list) -> list:
    labels = ["src", "dst", "op"]
    out = {k: CounterMetricFamily(f"shardlm_link_{k}", doc, labels=labels) for k, doc in (
        ("bytes", "Bytes over a link (see the module docstring for how collectives are attributed)."),
        ("seconds", "Seconds the receiving rank spent in the operation."),
        ("calls", "Operations over the link."))}
    for s, spec in zip(stats, specs):
        for op, c in (s.get("comms") or {}).items():
            pairs = link_pairs(op, spec, specs)
            share = 1 / (len(pairs) + 1) if op == "all_gather" else 1.0
            for src, dst in pairs:
                out["bytes"].add_metric([str(src), str(dst), op], c["bytes"] * share)
                out["seconds"].add_metric([str(src), str(dst), op], c["seconds"])
                out["calls"].add_metric([str(src), str(dst), op], c["calls"])
    return list(out.values())


def link_pairs(op: str, spec, specs: list) -> list[tuple[int, int]]:
    """(src, dst) links an operation of `spec`'s rank is counted on: each tensor-parallel peer -> this rank
    for a collective, this rank -> the next stage's rank of the same tp coordinate for a send; none for a
    receive (the sender counted it)."""
    if op.startswith("send"):
        peer = _stage_peer(spec, specs, +1)
        return [(spec.rank, peer)] if peer is not None else []
    if op.startswith("recv"):
        return []
    peers = [o.rank for o in specs if o.stage == spec.stage and o.replica == spec.replica and o.rank != spec.rank]
    return [(p, spec.rank) for p in peers]


def _stage_peer(spec, specs: list, delta: int) -> int | None:
    return next((o.rank for o in specs if o.stage == spec.stage + delta and o.tp_rank == spec.tp_rank
                 and o.replica == spec.replica), None)


def _steps(stats: list[dict], specs: list, plan) -> list:
    hist = HistogramMetricFamily("shardlm_stage_step_seconds", "Engine step time on each stage (its tp rank 0): "
                                 "prefill chunks and decode rows of one step, waits included.", labels=["stage"])
    wait = CounterMetricFamily("shardlm_stage_wait_seconds", "Of the step time, seconds in collectives and "
                               "transfers (waiting for peers).", labels=["stage"])
    pred = GaugeMetricFamily("shardlm_stage_step_seconds_predicted", "The plan's predicted time of one decode "
                             "step on each stage.", labels=["stage"])
    times = plan.predictions.performance.stage_times_s if plan.predictions else ()
    busy = {}
    for s, spec in zip(stats, specs):
        h = s.get("steps")
        if spec.tp_rank != 0 or not h:
            continue
        stage = str(spec.stage)
        cum, buckets = 0, []
        for bound, n in zip(h["bounds"], h["counts"]):
            cum += n
            buckets.append((str(bound), cum))
        buckets.append(("+Inf", h["count"]))
        hist.add_metric([stage], buckets, h["sum"])
        waited = sum(c["seconds"] for c in (s.get("comms") or {}).values())
        wait.add_metric([stage], waited)
        if spec.stage < len(times):
            pred.add_metric([stage], times[spec.stage])
        if h["count"]:
            busy[spec.stage] = max(h["sum"] - waited, 0.0) / h["count"]
    return [hist, wait, pred, *_balance(busy)]


def stage_imbalance(busy: dict[int, float]) -> float:
    """The plan's measure of imbalance on measured times: slowest stage / mean stage - 1 (0 for one stage)."""
    if len(busy) < 2 or not any(busy.values()):
        return 0.0
    return max(busy.values()) / (sum(busy.values()) / len(busy)) - 1


def _balance(busy: dict[int, float]) -> list:
    """Measured busy time per stage, the imbalance with the plan's limit, and each stage's out-of-balance flag
    (its busy time / the stages' mean - 1 over the limit), with more than one stage."""
    from shardlm.plan.plan import IMBALANCE_LIMIT

    if len(busy) < 2:
        return []
    per = GaugeMetricFamily("shardlm_stage_busy_seconds", "Mean seconds per engine step a stage computes (its step "
                            "time less its waits), the measured counterpart of the predicted stage time.",
                            labels=["stage"])
    flag = GaugeMetricFamily("shardlm_stage_out_of_balance", "1 when a stage's busy time exceeds the stages' mean by "
                             "more than the plan's limit (shardlm_stage_imbalance_limit).", labels=["stage"])
    mean = sum(busy.values()) / len(busy)
    for stage, seconds in sorted(busy.items()):
        per.add_metric([str(stage)], seconds)
        flag.add_metric([str(stage)], float(mean > 0 and seconds / mean - 1 > IMBALANCE_LIMIT))
    ratio = GaugeMetricFamily("shardlm_stage_imbalance_ratio", "Measured: slowest stage's busy time / the mean - 1.")
    ratio.add_metric([], stage_imbalance(busy))
    limit = GaugeMetricFamily("shardlm_stage_imbalance_limit", "The plan's largest allowed imbalance.")
    limit.add_metric([], IMBALANCE_LIMIT)
    return [per, flag, ratio, limit]
