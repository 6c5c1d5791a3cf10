"""`shardlm top URL`: a running server's /metrics in the terminal, refreshing, like htop for a sharded model."""

from __future__ import annotations

import time
from typing import Optional

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from shardlm.cli import options as o
from shardlm.cli.common import fail, out

KINDS = ("weights", "streamed", "kv_cache", "kv_cache_used", "rss", "gpu_allocated")


def top(
    url: str = typer.Argument("http://127.0.0.1:8000", help="The server, e.g. http://127.0.0.1:8000."),
    interval_s: float = typer.Option(2.0, "--interval-s", parser=o.TOP_INTERVAL_S, help="Seconds between refreshes."),
    count: Optional[int] = typer.Option(None, "--count", parser=o.TOP_COUNT, help="Refresh this many times, then exit (default: until Ctrl-C)."),
) -> None:
    """Watch a shardlm server: memory per rank by kind, traffic per link, latency, queue and balance."""
    import httpx

    from shardlm.serve.scrape import parse

    base = url.rstrip("/")
    previous: tuple[float, float] | None = None
    with Live(console=out, auto_refresh=False) as live:
        n = 0
        while count is None or n < count:
            try:
                text = httpx.get(base + "/metrics", timeout=10).text
            except httpx.HTTPError as e:
                fail(f"cannot read {base}/metrics ({type(e).__name__}: {e}); is `shardlm serve` running there?")
            snap, now = parse(text), time.monotonic()
            rate = None if previous is None else (snap.generated - previous[1]) / max(now - previous[0], 1e-9)
            previous = (now, snap.generated)
            live.update(render(snap, base, rate), refresh=True)
            n += 1
            if count is None or n < count:
                time.sleep(interval_s)


def render(snap, url: str, rate: float | None) -> Group:
    """The screen for one snapshot."""
    head = Text.assemble((f"shardlm top  {url}", "bold"), f"   running {snap.running:.0f}  waiting {snap.waiting:.0f}"
                         f"  KV cache {snap.kv_usage:.0%}  generated {snap.generated:.0f} tokens"
                         + (f"  ({rate:.1f} tok/s)" if rate is not None else ""))
    return Group(head, _memory(snap), _latency(snap), _links(snap), _stages(snap))


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def _memory(snap) -> Table:
    t = Table(title="memory per rank, MiB (measured / predicted)", title_justify="left")
    for col in ("rank", "stage", "tp", "device", *KINDS, "capacity"):
        t.add_column(col, justify="right")
    for r in snap.ranks:
        cells = []
        for kind in KINDS:
            got, want = r.memory.get(kind), r.predicted.get(kind)
            cells.append(_mib(got) + (f" / {_mib(want)}" if want else ""))
        t.add_row(str(r.rank), str(r.stage), str(r.tp_rank), r.device, *cells, _mib(r.capacity))
    return t


def _latency(snap) -> Table:
    t = Table(title="latency, ms", title_justify="left")
    for col in ("", "p50", "p90", "p99", "mean", "count"):
        t.add_column(col, justify="right")
    for name, label in (("ttft", "time to first token"), ("itl", "inter-token"), ("e2e", "end to end"),
                        ("queue", "queue")):
        h = snap.latency[name]
        t.add_row(label, *(f"{h[k] * 1000:.1f}" for k in ("p50", "p90", "p99", "mean")), f"{h['count']:.0f}")
    return t


def _links(snap) -> Table:
    ranks = sorted({r.rank for r in snap.ranks} | {a for a, _ in snap.links} | {b for _, b in snap.links})
    t = Table(title="traffic per link, MiB (row: from, column: to)", title_justify="left")
    t.add_column("from \\ to", justify="right")
    for r in ranks:
        t.add_column(str(r), justify="right")
    for a in ranks:
        t.add_row(str(a), *(_mib(snap.links[(a, b)]) if (a, b) in snap.links else "." for b in ranks))
    return t


def _stages(snap) -> Table:
    t = Table(title="step time per stage, ms (measured mean, busy part / predicted decode step)",
              title_justify="left")
    for col in ("stage", "step", "busy", "predicted", "balance"):
        t.add_column(col, justify="right")
    for stage, (got, want) in snap.stage_seconds.items():
        busy, slow = snap.stage_busy.get(stage, (None, False))
        t.add_row(str(stage), f"{got * 1000:.1f}", f"{busy * 1000:.1f}" if busy is not None else "-",
                  f"{want * 1000:.1f}" if want else "-", "[red]out of balance[/]" if slow else "ok")
    return t
