"""How fast can this machine's cores stream weights while doing the decode kernels' work on each byte, against the
read bandwidth the floor shares are taken from?

    python bench/stream_ceiling.py [--rounds 4] [--mb 135] [--repeats 5] [--no-write]

bench/floor_share.py and bench/decode.py take a format's floor as its weight bytes over torch's `sum()` read rate
(bench/decode_common.py's measure_bandwidth, 512 MiB). This script asks what that floor assumes: each round measures
`sum()`, then runs bench/stream_ceiling.cpp's loops (compiled here with -O3 -march=native, one thread a core, each
reading its half of an `--mb` buffer as one stream, asking for the line 4 KB ahead into L2 as the int8 kernels
do): a plain read, int8 rows with a float multiply-add a block of 32 (the float-summed int8 rows: q, k, v, gate, up
and the head), int8 rows summed in int32 (the exact rows' inner loop) and float32 rows (one FMA a vector), then
`sum()` again. Prints each loop's median GB/s a round and its share of the two `sum()` figures' mean: a loop that
stays well under 100 % while `sum()` is high is bound by the cores, not by memory.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SOURCE = BENCH / "stream_ceiling.cpp"
VARIANTS = ("read", "int8-float", "int8-int", "f32")
HEADING = "## How fast the cores stream weights with the kernels' work on them (bench/stream_ceiling.py)"


def compiled() -> Path:
    """The loops' binary, built once per source text under the kernel cache's tools folder."""
    from shardlm.settings import Settings

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    binary = Settings.from_env().home / "tools" / "stream_ceiling" / digest
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(".tmp")
        res = subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", "-pthread", str(SOURCE), "-o", str(tmp)],
                             capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise SystemExit(f"compiling {SOURCE.name} failed (g++ needed):\n{res.stderr[-2000:]}")
        tmp.replace(binary)
    return binary


def one_round(binary: Path, mb: int, repeats: int) -> dict:
    """`sum()` GB/s before and after, and each loop's median GB/s over `repeats` (loops alternating)."""
    from decode_common import measure_bandwidth

    before = measure_bandwidth(512, 64, 6)["read"]
    res = subprocess.run([str(binary), str(mb), str(repeats), *VARIANTS], capture_output=True, text=True,
                         timeout=600, check=True)
    after = measure_bandwidth(512, 64, 6)["read"]
    got: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for line in res.stdout.splitlines():
        name, rate = line.split()[:2]
        got[name].append(float(rate))
    return {"before": before, "after": after, **{v: statistics.median(r) for v, r in got.items()}}


def row(i: int, r: dict) -> str:
    """A round's table row: `sum()` before-after, each loop's GB/s and share of the `sum()` mean."""
    mean = (r["before"] + r["after"]) / 2
    cells = [f"{r[v]:.1f} ({r[v] / mean * 100:.0f} %)" for v in VARIANTS]
    return f"| {i} | {r['before']:.1f}-{r['after']:.1f} | " + " | ".join(cells) + " |"


def main() -> None:
    """Run the rounds, print the table, record it in RESULTS.md unless --no-write."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--mb", type=int, default=135, help="buffer MB (default: the bundled int8 rank's weight bytes)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if min(args.rounds, args.mb, args.repeats) < 1:
        raise SystemExit("--rounds, --mb and --repeats must be 1 or more")
    sys.path.insert(0, str(BENCH))
    from decode_common import record

    binary = compiled()
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    rows = ["| round | `sum()` GB/s before-after | " + " | ".join(f"{v} GB/s (share)" for v in VARIANTS) + " |",
            "|---" * (2 + len(VARIANTS)) + "|"]
    for i in range(1, args.rounds + 1):
        rows.append(row(i, one_round(binary, args.mb, args.repeats)))
        print(rows[-1], flush=True)
    record(HEADING, f"python bench/stream_ceiling.py --rounds {args.rounds} --mb {args.mb} --repeats {args.repeats}",
           started, "One thread a core, each streaming its half of the buffer; medians of the repeats; shares of the "
           "mean of the `sum()` figures around them.", rows, args.no_write)


if __name__ == "__main__":
    main()
