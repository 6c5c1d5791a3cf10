"""Batch-1 decode in-process against the read bandwidth of the same moment: is a format's step bound by memory?

    python bench/floor_share.py [--formats int4,int8,float32,bfloat16] [--rounds 4] [--no-write]

Per format, one process builds rank 0 of the bundled model's one-rank plan (int8/int4 with the int8 embedding; started
with a rank's environment, so its weights sit on huge pages unless SHARDLM_HUGE_PAGES=0) and
times a SlotRunner with no engine around it: each round prefills a 40-token prompt, then decodes 128 greedy tokens in
steps of 8 (contexts 40-168), with the read bandwidth (bench/decode_common.py's `sum()` over 512 MiB) measured right
before and right after. A round's floor is the rank's resident weight bytes over the mean of the two bandwidths; its
share is floor time / step time. A format whose share stays low while the bandwidth is high is bound by its kernels,
not by memory; bench/decode.py's floor shares, taken through the engine, cannot tell the two apart.
"""

from __future__ import annotations

import datetime as dt
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
HEADING = "## Batch-1 decode in-process against the bandwidth of its moment (bench/floor_share.py)"


def child(fmt: str, rounds: int) -> list[dict]:
    """In a process of its own: each round's ms a token, bandwidth before and after, and weight bytes."""
    sys.path.insert(0, str(BENCH))
    from decode_common import measure_bandwidth
    from shardlm.runtime.protocol import SamplingParams
    from shardlm.runtime.work import Decode, Prefill, SlotStart, Step
    from step_vs_commit import one_rank_runner

    runner = one_rank_runner({"float32": "f32", "bfloat16": "bf16"}.get(fmt, fmt), 2)
    greedy, prompt = SamplingParams(), tuple(range(100, 140))
    out = []
    for r in range(rounds + 1):  # round 0 warms up
        runner.run(Step(0, (SlotStart(0, 0),), (Prefill(0, prompt, 0, True, greedy),), ()))
        before = measure_bandwidth(512, 64, 6)["read"]
        t0 = time.perf_counter()
        for i in range(16):
            runner.run(Step(1 + i, (), (), (Decode(0, None if i else 5, len(prompt) + 8 * i, greedy),), 8))
        ms = (time.perf_counter() - t0) / 128 * 1e3
        after = measure_bandwidth(512, 64, 6)["read"]
        if r:
            out.append({"ms": ms, "before": before, "after": after, "bytes": runner.rank.resident_bytes()})
    return out


def share(r: dict) -> float:
    """A round's floor time over its step time."""
    return r["bytes"] / ((r["before"] + r["after"]) / 2 * 1e9) * 1e3 / r["ms"]


def row(fmt: str, got: list[dict]) -> str:
    """The table row of one format's rounds."""
    ms = " / ".join("%.2f" % r["ms"] for r in got)
    bw = " / ".join("%.0f-%.0f" % (r["before"], r["after"]) for r in got)
    shares = " / ".join("%.0f %%" % (share(r) * 100) for r in got)
    mid = statistics.median(share(r) for r in got) * 100
    return f"| {fmt} | {got[0]['bytes'] / 1e6:.1f} | {ms} | {bw} | {shares} | {mid:.0f} % |"


def main() -> None:
    """Run each format in a child process, print the table, record it unless --no-write."""
    sys.path.insert(0, str(BENCH))
    from decode_common import format_args, format_child, record

    args = format_args(__doc__, "int4,int8,float32,bfloat16", 4, child)
    if args is None:
        return

    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    rows = ["| format | MB a token | ms a token (rounds) | read GB/s before / after (rounds) | share of the floor "
            "(rounds) | median |", "|---|---|---|---|---|---|"]
    for fmt in args.formats.split(","):
        rows.append(row(fmt, format_child(__file__, fmt, args.rounds)))
        print(rows[-1], flush=True)
    record(HEADING, f"python bench/floor_share.py --formats {args.formats} --rounds {args.rounds}", started,
           "In-process SlotRunner, batch 1, contexts 40-168, steps of 8 tokens.", rows, args.no_write)

if __name__ == "__main__":
    main()
