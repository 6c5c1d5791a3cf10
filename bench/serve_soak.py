"""Serving soak: one `shardlm serve` under mixed streaming load, a long idle spell, then load again.

    python bench/serve_soak.py [--minutes M] [--idle-minutes I] [--gaps G] [--tp N] [--clients C] [--no-write]

The hour-long run: `--minutes 14 --idle-minutes 10 --gaps 2` (three load phases of 14 minutes, two idle
spells of 10). Load: C client threads, each streaming requests back to back (a random prompt, 8..64 new tokens, EOS
ignored, every other request sampled at temperature 1, the rest greedy); every tenth request is cancelled after its
third chunk. A probe request (greedy, fixed) runs every 20 s and must always return the same text as its first
answer, loaded or not. Between load phases the server sits idle for I minutes (default 10), far past the collective
timeout: the ranks wait in no collective, so the first request after an idle spell must succeed like any other.

Reported: requests done, failed, cancelled; probe mismatches; output tokens/s per phase; the server's
resident memory (driver + ranks) after warm-up and after every phase, and sampled every 20 s over the
whole run (bench/serve_soak.png).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import decode as _decode  # noqa: E402
from serving import KEY, NAME, Server  # noqa: E402

HEADING = "## Serving soak: load, a long idle spell, load again (bench/serve_soak.py)"
PROMPTS = ["Tell me about the history of Rome.", "def quicksort(xs):", "The weather today is",
           "List three uses of copper:", "Once upon a time", "SELECT * FROM orders WHERE", "Dear diary,",
           "The mitochondria is"]
PROBE = ("The capital of France is", 16)
FIGURE = Path(__file__).resolve().parent / "serve_soak.png"


@dataclass
class Tally:
    """What one load phase did."""

    done: int = 0
    failed: int = 0
    cancelled: int = 0
    tokens: int = 0
    probe_mismatch: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **kw) -> None:
        """Add counts (thread-safe)."""
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


def stream_one(http, url: str, prompt: str, n: int, cancel: bool, temperature: float = 0.0) -> int:
    """Stream one completion; the tokens received (cancelled after 3 chunks when `cancel`)."""
    body = {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks, usage = 0, 0
    with http.stream("POST", url + "/v1/completions", json=body) as res:
        if res.status_code != 200:
            raise RuntimeError(f"HTTP {res.status_code}: {res.read()[:300]!r}")
        for line in res.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:  # an error event (a sampled token's text may itself be "error")
                raise RuntimeError(line[:300])
            chunks += 1
            if event.get("usage"):
                usage = int(event["usage"]["completion_tokens"])
            if cancel and chunks == 3:
                return 0
    return usage


def client(url: str, deadline: float, tally: Tally, seed: int) -> None:
    """One client thread: requests back to back until `deadline`."""
    import httpx

    rng = random.Random(seed)
    with httpx.Client(timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as http:
        i = 0
        while time.monotonic() < deadline:
            i += 1
            cancel = i % 10 == 0
            try:  # every other request samples (temperature 1), the rest are greedy
                got = stream_one(http, url, rng.choice(PROMPTS), rng.randint(8, 64), cancel, float(i % 2))
                tally.add(done=1, tokens=got, cancelled=int(cancel))
            except Exception as e:  # noqa: BLE001 - counted and shown, the soak goes on
                tally.add(failed=1)
                with tally.lock:
                    tally.errors.append(f"{type(e).__name__}: {e}"[:300])
                print(f"  a request failed: {tally.errors[-1]}", flush=True)


def probe(server: Server) -> str:
    """The fixed greedy request's text."""
    res = server.post("/v1/completions", {"model": NAME, "prompt": PROBE[0], "max_tokens": PROBE[1],
                                          "temperature": 0, "ignore_eos": True}, timeout=300)
    res.raise_for_status()
    return res.json()["choices"][0]["text"]


def load_phase(server: Server, minutes: float, clients: int, want: str, seed: int,
               trace: list) -> tuple[Tally, float]:
    """`clients` threads for `minutes`, a probe and a memory sample (into `trace`) every 20 s; the tally and
    the phase's seconds."""
    tally, t0 = Tally(), time.monotonic()
    deadline = t0 + minutes * 60
    threads = [threading.Thread(target=client, args=(server.url, deadline, tally, seed + k)) for k in range(clients)]
    for t in threads:
        t.start()
    while time.monotonic() < deadline:
        time.sleep(min(20, max(0.0, deadline - time.monotonic())))
        tally.add(probe_mismatch=int(probe(server) != want))
        trace.append((time.monotonic(), server_rss_mib(server), "load"))
    for t in threads:
        t.join(timeout=600)
    return tally, time.monotonic() - t0


def idle_phase(server: Server, minutes: float, want: str, trace: list) -> bool:
    """Send nothing for `minutes` (a memory sample every 20 s); whether the probe after it answers as before."""
    deadline = time.monotonic() + minutes * 60
    while time.monotonic() < deadline:
        time.sleep(min(20, max(0.0, deadline - time.monotonic())))
        trace.append((time.monotonic(), server_rss_mib(server), "idle"))
    return probe(server) == want


def phases(gaps: int) -> list[tuple[str, int | None]]:
    """Load phases with `gaps` idle spells between them: (name, client seed or None for idle)."""
    out: list[tuple[str, int | None]] = [("load 1", 0)]
    for k in range(gaps):
        out += [(f"idle {k + 1}" if gaps > 1 else "idle", None), (f"load {k + 2}", 100 * (k + 1))]
    return out


def server_rss_mib(server: Server) -> float:
    """Resident memory of the server and its ranks, MiB."""
    import psutil

    root = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20


def main() -> None:
    """Run the soak, print, and (unless --no-write) record it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="minutes of load in each load phase")
    ap.add_argument("--idle-minutes", type=float, default=10.0)
    ap.add_argument("--gaps", type=int, default=1, help="idle spells, each between two load phases")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    rows, mem, trace = [], {}, []
    with Server("--tp", str(args.tp), "--max-batch", "8", "--max-seq-len", "512", ready_s=600) as server:
        want = probe(server)
        t0 = time.monotonic()
        mem["after warm-up"] = server_rss_mib(server)
        trace.append((t0, mem["after warm-up"], "load"))
        for phase, seed in phases(args.gaps):
            print(f"{phase}...", flush=True)
            if seed is None:
                ok = idle_phase(server, args.idle_minutes, want, trace)
                rows.append((phase, None, args.idle_minutes * 60, ok))
            else:
                tally, secs = load_phase(server, args.minutes, args.clients, want, seed, trace)
                rows.append((phase, tally, secs, None))
                print(f"  {tally.done} done, {tally.failed} failed, {tally.cancelled} cancelled, "
                      f"{tally.tokens / secs:.1f} tok/s, probe mismatches {tally.probe_mismatch}", flush=True)
            mem[f"after {phase}"] = server_rss_mib(server)
        stats = server.stats()
    rc = server.returncode
    if not args.no_write:  # --no-write leaves RESULTS.md and the picture as they are
        figure([(t - t0, rss, kind) for t, rss, kind in trace])
    text = report(args, started, rows, mem, stats, rc)
    print(text)
    if not args.no_write:
        _decode.write_section(text, HEADING)


def report(args, started: str, rows: list, mem: dict, stats: dict, rc: int) -> str:
    """The RESULTS.md section."""
    info = _decode.machine_info()
    lines = [HEADING, "", f"Command: `python bench/serve_soak.py --minutes {args.minutes:g} --idle-minutes "
             f"{args.idle_minutes:g} --gaps {args.gaps} --tp {args.tp} --clients {args.clients}`. Date: {started}. Machine: "
             f"{info['cpu']}, {info['cores']} cores, {info['ram']}. Bundled SmolLM2-135M, float32, 8 slots.", "",
             "| phase | seconds | requests done | failed | cancelled (on purpose) | output tok/s | probe equal |",
             "|---|---|---|---|---|---|---|"]
    for phase, tally, secs, ok in rows:
        if tally is None:
            lines.append(f"| {phase} | {secs:.0f} | - | - | - | - | {'yes' if ok else '**no**'} |")
        else:
            lines.append(f"| {phase} | {secs:.0f} | {tally.done} | {tally.failed} | {tally.cancelled} | "
                         f"{tally.tokens / secs:.1f} | {'yes' if not tally.probe_mismatch else '**no**'} |")
    lines += ["", "Server memory (driver + ranks, RSS MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in mem.items())
              + f". Engine at the end: {stats.get('running')} running, {stats.get('free_slots')} of "
              f"{stats.get('slots')} slots free, finished by reason {stats.get('finished')}. SIGTERM exit status: {rc}."]
    errors = [e for _, t, _, _ in rows if t for e in t.errors[:3]]
    if errors:
        lines += ["", "First errors: " + "; ".join(errors)]
    if FIGURE.exists():
        lines += ["", f"![server memory over the soak]({FIGURE.name})"]
    return "\n".join(lines) + "\n"


def figure(points: list[tuple[float, float, str]]) -> None:
    """Server RSS against minutes since warm-up, load and idle samples marked (bench/serve_soak.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=120)
    for kind, colour in (("load", "tab:blue"), ("idle", "tab:grey")):
        pts = [(t / 60, rss) for t, rss, k in points if k == kind]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, color=colour, label=kind)
    top = max(rss for _, rss, _ in points)
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("minutes since warm-up")
    ax.set_ylabel("server RSS, MiB (driver + ranks)")
    ax.set_title("shardlm serve soak: resident memory")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(FIGURE)
    plt.close(fig)


if __name__ == "__main__":
    main()
