"""Greedy decode runs in one compiled call against the same runs one Python step at a time (runtime/greedy_run.py).

    python bench/greedy_runs.py [--formats int4,int8,float32,bfloat16] [--batches 1,4] [--rounds 5] [--no-write]

One in-process SlotRunner per format (rank 0 of the bundled model's one-rank plan, as bench/step_vs_commit.py builds
it; int8/int4 with the int8 embedding), no engine. Each sample: a 40-token prompt per row, then steps of 8 decode
tokens (contexts 40-168), the runner's compiled runs on or off; within a round the two alternate, first one then the
other, so the VM's swings in read bandwidth hit both. Every sample's tokens must equal the first sample's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_common import machine_info, write_section  # noqa: E402
from step_vs_commit import one_rank_runner  # noqa: E402

HEADING = "## Greedy decode runs compiled against Python steps (bench/greedy_runs.py)"
FORMATS = {"int4": "int4", "int8": "int8", "float32": "f32", "bfloat16": "bf16"}
RUN, STEPS, PROMPT = 8, 16, 40


def sample(runner, batch: int, compiled: bool, greedy_runs) -> tuple[float, list]:
    """ms a decode run (one token for each row; decode steps only) and the tokens of `batch` rows through STEPS steps
    of RUN runs."""
    from shardlm.runtime.protocol import SamplingParams
    from shardlm.runtime.work import Decode, Prefill, SlotStart, Step

    runner.greedy = greedy_runs if compiled else None
    greedy = SamplingParams()
    prompts = [tuple(100 + 7 * j + i for i in range(PROMPT)) for j in range(batch)]
    runner.run(Step(0, tuple(SlotStart(j, j) for j in range(batch)),
                    tuple(Prefill(j, p, 0, True, greedy) for j, p in enumerate(prompts)), ()))
    tokens, t0 = [], time.perf_counter()
    for i in range(STEPS):
        decodes = tuple(Decode(j, None, PROMPT + RUN * i, greedy) for j in range(batch))
        res = runner.run(Step(1 + i, (), (), decodes, RUN))
        tokens.append([res.slots[j].token for j in range(batch)] + [r[j].token for r in res.later for j in range(batch)])
    took = time.perf_counter() - t0
    return took / (STEPS * RUN) * 1e3, tokens


def measure(fmt: str, batches: list[int], rounds: int) -> dict:
    """{batch: {"compiled": [ms], "python": [ms]}} for one format."""
    runner = one_rank_runner(FORMATS[fmt], max(batches))
    greedy_runs = runner.greedy
    if greedy_runs is None:
        raise SystemExit(f"{fmt}: the rank does not take compiled greedy runs")
    got: dict[int, dict[str, list[float]]] = {}
    for b in batches:
        sample(runner, b, True, greedy_runs)  # warm-up
        first = None
        got[b] = {"compiled": [], "python": []}
        for r in range(rounds):
            for compiled in ((True, False) if r % 2 == 0 else (False, True)):
                ms, tokens = sample(runner, b, compiled, greedy_runs)
                first = first or tokens
                if tokens != first:
                    raise SystemExit(f"{fmt} batch {b}: the tokens differ between samples")
                got[b]["compiled" if compiled else "python"].append(ms)
            print(f"{fmt} batch {b} round {r + 1}/{rounds}: compiled {got[b]['compiled'][-1]:.3f}, "
                  f"python {got[b]['python'][-1]:.3f} ms a run", flush=True)
    runner.greedy = greedy_runs
    return got


def table(results: dict) -> list[str]:
    rows = ["| format | rows | compiled: ms a decode run (a token a row), median (min-max) | Python steps | "
            "compiled / Python |",
            "|---|---|---|---|---|"]
    for fmt, by_batch in results.items():
        for b, got in by_batch.items():
            c, p = statistics.median(got["compiled"]), statistics.median(got["python"])
            rows.append(f"| {fmt} | {b} | {c:.3f} ({min(got['compiled']):.3f}-{max(got['compiled']):.3f}) | "
                        f"{p:.3f} ({min(got['python']):.3f}-{max(got['python']):.3f}) | {c / p:.3f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md as it is")
    args = ap.parse_args()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"--formats: unknown {', '.join(unknown)}; use {', '.join(FORMATS)}")
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 or b > 16 for b in batches):
        raise SystemExit("--batches: each between 1 and 16 (the compiled run takes up to 16 rows)")
    results = {fmt: measure(fmt, batches, args.rounds) for fmt in formats}
    m = machine_info()
    text = "\n".join([HEADING, "", f"Command: `python bench/greedy_runs.py --formats {args.formats} --batches "
                      f"{args.batches} --rounds {args.rounds}`. Date: {dt.datetime.now():%Y-%m-%d %H:%M}. Machine: "
                      f"{m['cpu']}, {m['cores']} cores, {m['ram']}; torch {m['torch']}. In-process SlotRunner, "
                      f"steps of {RUN} tokens, contexts {PROMPT}-{PROMPT + RUN * STEPS}; tokens equal in every sample.",
                      "", *table(results), ""])
    print(text)
    if not args.no_write:
        write_section(text, HEADING)


if __name__ == "__main__":
    main()
