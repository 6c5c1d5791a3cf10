"""Batch-1 decode through the engine with steps of one decode token against steps of several (Engine.decode_run).

    python bench/decode_runs.py [--runs 1,8] [--formats int4,int8,float32,bfloat16] [--rounds 5] [--new-tokens 128]
                                [--no-write]

One LocalEngine per format (bundled model, tp 1, int8/int4 with the int8 embedding), kept for the whole run; within
each round the engine switches between the run lengths in a rotating order, so the VM's swings in read bandwidth
hit them alike. Each sample is one `generate` of --new-tokens greedy tokens (EOS ignored) from a 40-token prompt;
decode tok/s is GenerateResult's (from the first token to the last as the driver saw them). Every sample's tokens
must equal the first sample's: a run of decode tokens gives the same tokens as single steps.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_common import machine_info, write_section  # noqa: E402
from shardlm.bundled import default_model_dir  # noqa: E402
from shardlm.engine import LocalEngine  # noqa: E402
from shardlm.engine.session import plan_run  # noqa: E402
from shardlm.plan.plan import KVBudget  # noqa: E402
from shardlm.plan.run import RunFlags  # noqa: E402
from shardlm.runtime.protocol import SamplingParams  # noqa: E402

HEADING = "## Runs of decode tokens: one step message per token or per several (bench/decode_runs.py)"
PROMPT = list(range(100, 140))


def measure(fmt: str, runs: list[int], rounds: int, new: int) -> dict[int, list[float]]:
    """tok/s samples per run length for one format."""
    quant = fmt if fmt in ("int8", "int4") else "none"
    flags = RunFlags(tp=1, dtype="bfloat16" if fmt == "bfloat16" else "float32", quantization=quant,
                     quantize_embedding=quant != "none")
    plan, source = plan_run(str(default_model_dir(progress=False)), flags, KVBudget(2, 1024, 512))
    got: dict[int, list[float]] = {k: [] for k in runs}
    with LocalEngine(plan, source) as engine:
        engine.generate([PROMPT], 8, SamplingParams(), 0, ignore_eos=True)  # warm-up
        first = None
        for r in range(rounds):
            for k in runs[r % len(runs):] + runs[:r % len(runs)]:
                engine.scheduler.decode_run = k
                res = engine.generate([PROMPT], new, SamplingParams(), 0, ignore_eos=True)
                first = first or res.token_ids
                if res.token_ids != first:
                    raise SystemExit(f"{fmt}: runs of {k} gave other tokens than the first sample")
                got[k].append(res.decode_tokens / res.decode_s)
                print(f"{fmt} round {r + 1}: runs of {k}: {got[k][-1]:.1f} tok/s", flush=True)
    return got


def table(results: dict[str, dict[int, list[float]]], runs: list[int]) -> list[str]:
    """Markdown rows: median (min-max) per run length, and each against runs of the first length."""
    base = runs[0]
    head = "| format | " + " | ".join(f"runs of {k}: tok/s median (min-max)" for k in runs) + " | " + \
        " | ".join(f"{k} / {base}" for k in runs[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(runs) - 1)]
    for fmt, got in results.items():
        med = {k: statistics.median(v) for k, v in got.items()}
        cells = [f"{med[k]:.1f} ({min(got[k]):.1f}-{max(got[k]):.1f})" for k in runs]
        lines.append(f"| {fmt} | " + " | ".join(cells) + " | " +
                     " | ".join(f"{med[k] / med[base]:.2f}x" for k in runs[1:]) + " |")
    return lines


def main() -> None:
    """Measure, print the table, and record it in bench/RESULTS.md unless --no-write."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="1,8")
    ap.add_argument("--formats", default="int4,int8,float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    runs = [int(k) for k in args.runs.split(",")]
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    results = {fmt: measure(fmt, runs, args.rounds, args.new_tokens) for fmt in args.formats.split(",")}
    info = machine_info()
    lines = [HEADING, "",
             f"Command: `python bench/decode_runs.py --runs {args.runs} --formats {args.formats} --rounds "
             f"{args.rounds} --new-tokens {args.new_tokens}`. Date: {started}. Machine: {info['cpu']}, "
             f"{info['cores']} cores, {info['ram']}; torch {info['torch']}. Bundled model, tp 1, batch 1, one "
             "LocalEngine per format switching run lengths in a rotating order; every sample's tokens equal.", "",
             *table(results, runs)]
    print("\n".join(lines))
    if not args.no_write:
        write_section("\n".join(lines), HEADING)


if __name__ == "__main__":
    main()
