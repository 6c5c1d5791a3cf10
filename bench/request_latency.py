"""Per-request latency of `shardlm serve` over one kept-alive connection (as the `openai` client holds it) and
over a new connection each time.

    python bench/request_latency.py [--requests 20] [--dtype float32] [--no-write]

One server (tp 1, the bundled model) on 127.0.0.1; httpx sends GET /health, GET /v1/models and a completion of
max_tokens 1 for a 1-token and a 64-token prompt (token ids), each --requests times (the first two dropped),
and reports the median milliseconds. The server's own arrival-to-finish time (its /metrics histogram) is printed
beside the completions, so the difference is what the connection adds. A reply that waits for the client's
delayed ACK shows as ~40 ms on the kept-alive connection only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import decode as _decode  # noqa: E402
from serving import NAME, Server  # noqa: E402

HEADING = "## Request latency over kept-alive and new connections (bench/request_latency.py)"


def e2e_ms(url: str) -> tuple[float, float]:
    """The server's e2e request latency histogram: (sum in ms, count)."""
    import httpx

    total = count = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("shardlm_e2e_request_latency_seconds_sum"):
            total = float(line.split()[-1]) * 1e3
        elif line.startswith("shardlm_e2e_request_latency_seconds_count"):
            count = float(line.split()[-1])
    return total, count


def timed(send, n: int) -> float:
    """Median ms of `send()` over n calls, the first two dropped."""
    ms = []
    for i in range(n):
        t0 = time.perf_counter()
        send(i)
        ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms[2:])


def measure(url: str, n: int) -> list[tuple[str, float, float, str]]:
    """(what, kept-alive ms, new-connection ms, server ms) rows."""
    import httpx

    kept = httpx.Client(timeout=60)
    rows = []
    for path in ("/health", "/v1/models"):
        rows.append((f"GET {path}", timed(lambda i: kept.get(url + path), n),
                     timed(lambda i: httpx.get(url + path, timeout=60), n), "-"))
    for plen in (1, 64):
        def body(i):
            return {"model": NAME, "prompt": [1000 + i + t for t in range(plen)], "max_tokens": 1, "temperature": 0}
        before = e2e_ms(url)
        a = timed(lambda i: kept.post(url + "/v1/completions", json=body(i)), n)
        b = timed(lambda i: httpx.post(url + "/v1/completions", json=body(i), timeout=60), n)
        after = e2e_ms(url)
        server = (after[0] - before[0]) / max(after[1] - before[1], 1)
        rows.append((f"completion, {plen}-token prompt, max_tokens 1", a, b, f"{server:.1f}"))
    kept.close()
    return rows


def main() -> None:
    """Start a server, measure, print, and (unless --no-write) record the section."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    with Server("--dtype", args.dtype, "--max-batch", "4", "--max-seq-len", "512", api_key=None,
                ready_s=600) as server:
        rows = measure(server.url, args.requests)
    info = _decode.machine_info()
    lines = [HEADING, "",
             f"Command: `python bench/request_latency.py --requests {args.requests} --dtype {args.dtype}`. Date: "
             f"{started}. Machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}. `shardlm serve` tp 1, "
             "the bundled model; httpx; medians of the requests after the first two.", "",
             "| request | kept-alive connection, ms | new connection each time, ms "
             "| server's own arrival-to-finish, ms |",
             "|---|---|---|---|"]
    lines += [f"| {what} | {a:.1f} | {b:.1f} | {s} |" for what, a, b, s in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        _decode.write_section(text, HEADING)


if __name__ == "__main__":
    main()
