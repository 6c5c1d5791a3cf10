"""Prefill of one prompt in-process: a shardlm rank against transformers, in one process, alternating.

    python bench/prefill_vs_transformers.py [--formats bf16,f32] [--tokens 512] [--rounds 6]

bench/decode.py compares prefill through the engine (its samples minutes apart, each system in its own process);
this script takes the engine out: rank 0 of the bundled model's one-rank plan in a SlotRunner
(bench/step_vs_commit.py's `one_rank_runner`) and transformers' `model(ids, use_cache=True, logits_to_keep=1)` (the
call its generate makes first) in the same process, on the machine's cores, a prefill of each in turn per round, so
both see the same minutes of this VM. Prints each format's median tokens/s (min-max), the first round left out
(warm-up), and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
from step_vs_commit import one_rank_runner  # noqa: E402  (a sibling script)

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def rates(fmt: str, tokens: int, rounds: int) -> tuple[list[float], list[float]]:
    """tokens/s of each round's prefill: shardlm's and transformers', in turn."""
    from transformers import AutoModelForCausalLM

    from shardlm.bundled import default_model_dir
    from shardlm.runtime.protocol import SamplingParams
    from shardlm.runtime.work import Prefill, SlotStart, Step

    runner = one_rank_runner(fmt, 2)
    theirs_model = AutoModelForCausalLM.from_pretrained(str(default_model_dir(progress=False)),
                                                        dtype=DTYPES[fmt]).eval()
    ids = torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))
    prompt, greedy = tuple(ids[0].tolist()), SamplingParams()
    ours, theirs = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        runner.run(Step(r, (SlotStart(0, 0),), (Prefill(0, prompt, 0, True, greedy),), ()))
        ours.append(tokens / (time.perf_counter() - t0))
        with torch.no_grad():
            t0 = time.perf_counter()
            theirs_model(ids, use_cache=True, logits_to_keep=1)
            theirs.append(tokens / (time.perf_counter() - t0))
    return ours, theirs


def row(fmt: str, ours: list[float], theirs: list[float]) -> str:
    """One table row from the rounds after the first."""
    a, b = ours[1:] or ours, theirs[1:] or theirs
    return (f"| {fmt} | {statistics.median(a):.0f} ({min(a):.0f}-{max(a):.0f}) | {statistics.median(b):.0f} "
            f"({min(b):.0f}-{max(b):.0f}) | {statistics.median(a) / statistics.median(b):.2f}x |")


def main() -> None:
    """Each format in turn; print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="bf16,f32")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    bad = [f for f in args.formats.split(",") if f not in DTYPES]
    if bad or args.tokens < 1 or args.rounds < 1:
        raise SystemExit(f"--formats takes {', '.join(DTYPES)} (got {args.formats}); --tokens and --rounds 1 or more")
    print(f"{torch.get_num_threads()} threads; a {args.tokens}-token prompt; {args.rounds} rounds, the first left out")
    print("| format | shardlm tok/s, median (min-max) | transformers | shardlm / transformers |")
    print("|---|---|---|---|")
    for fmt in args.formats.split(","):
        print(row(fmt, *rates(fmt, args.tokens, args.rounds)), flush=True)


if __name__ == "__main__":
    main()
