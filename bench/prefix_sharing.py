"""n samples of one prompt, with the engine's prefix sharing on and off: time to the last token, prompt tokens
computed, and whether the tokens agree.

    python bench/prefix_sharing.py [--choices 1,4,8,16] [--prompt-len 400] [--max-tokens 16] [--rounds 3]
                                   [--tp 1] [--no-write]

One in-process engine (the bundled model, float32, --tp ranks, KV-cache slots for the most choices) takes, per
case, `choices` requests of one random `--prompt-len`-token prompt submitted together (as `n` in one OpenAI call
submits them), sampled at temperature 1 with seeds 0 .. n-1 for `--max-tokens` tokens. Sharing on, the copies
compute the prompt once (engine/scheduler.py); off (Scheduler.share_prefixes False), each computes its own (every
case starts from slots that keep no prompt: a prompt sent again is not what this measures). Both
run in every round, alternating; the table gives medians over rounds of the seconds from submission to the last
token. The tokens of every request must be the same either way (same seeds, same bits); the script exits 1 if not.
"""

from __future__ import annotations

import argparse
import datetime as dt
import queue
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

HEADING = "## n samples of one prompt with prefix sharing on and off (bench/prefix_sharing.py)"


def one_case(engine, prompt: list[int], n: int, max_tokens: int, share: bool) -> tuple[float, int, list]:
    """Seconds from submitting n requests of `prompt` to the last token, prompt tokens computed, their tokens."""
    from shardlm.engine.requests import GenerationParams

    deadline = time.monotonic() + 30
    while engine.stats().running and time.monotonic() < deadline:  # the last case's requests released
        time.sleep(0.01)
    engine.scheduler.share_prefixes = share
    engine.scheduler.held.clear()  # no slot keeps the prompt from the case before: n choices, not a prompt sent again
    sink: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    reqs = [engine.submit(prompt, GenerationParams(max_tokens, 1.0, seed=s, ignore_eos=True), sink=sink)
            for s in range(n)]
    left = n
    while left:
        _, event = sink.get(timeout=600)
        if event.finish_reason == "error":
            raise SystemExit(f"the engine failed: {event.error}")
        left -= event.finish_reason is not None
    seconds = time.perf_counter() - t0
    return seconds, sum(len(r.prompt_ids) - r.shared for r in reqs), [r.output_ids for r in reqs]


def main() -> None:
    """Run the rounds, print the table, record it unless --no-write."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--choices", default="1,4,8,16", help="comma-separated n of each case")
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md as it is")
    args = ap.parse_args()
    from decode_common import record
    from shardlm.engine import LocalEngine
    from shardlm.engine.session import plan_run
    from shardlm.plan.plan import KVBudget
    from shardlm.plan.run import RunFlags

    ns = [int(c) for c in args.choices.split(",")]
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    seq = args.prompt_len + args.max_tokens
    plan, source = plan_run(None, RunFlags(tp=args.tp), kv=KVBudget(max(ns), seq, 512))
    prompt = [random.Random(0).randrange(100, source.args.vocab_size) for _ in range(args.prompt_len)]
    got: dict = {(n, share): [] for n in ns for share in (True, False)}
    computed, same = {}, True
    with LocalEngine(plan, source) as engine:
        one_case(engine, prompt[:32], 2, 2, True)  # warm-up
        for r in range(args.rounds):
            for n in ns:
                tokens = {}
                for share in ((True, False) if r % 2 == 0 else (False, True)):
                    seconds, computed[(n, share)], tokens[share] = one_case(engine, prompt, n, args.max_tokens, share)
                    got[(n, share)].append(seconds)
                    print(f"round {r + 1} n={n} sharing {'on' if share else 'off'}: {seconds:.2f} s, "
                          f"{computed[(n, share)]} prompt tokens computed", flush=True)
                same &= tokens[True] == tokens[False]
    rows = ["| n | sharing on: s to the last token | off | off / on | prompt tokens computed, on / off |",
            "|---|---|---|---|---|"]
    for n in ns:
        on, off = statistics.median(got[(n, True)]), statistics.median(got[(n, False)])
        rows.append(f"| {n} | {on:.2f} | {off:.2f} | {off / on:.2f} | {computed[(n, True)]} / {computed[(n, False)]} |")
    rows.append(f"\nTokens with sharing on and off: {'the same for every request' if same else 'DIFFERENT'}.")
    record(HEADING, f"python bench/prefix_sharing.py --choices {args.choices} --prompt-len {args.prompt_len} "
                    f"--max-tokens {args.max_tokens} --rounds {args.rounds} --tp {args.tp}", started,
           f"In-process engine, the bundled model float32 at tp {args.tp}; medians of {args.rounds} rounds, sharing on "
           "and off alternating.", rows, args.no_write)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
