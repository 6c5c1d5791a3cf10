"""A rank's step time in-process, this tree against an earlier commit: did a kernel change pay?

    python bench/step_vs_commit.py [--commit 095f1fe] [--rounds 3] [--cases f32:1,f32:16,int4:1]
                                   [--steps 100] [--no-write]

Each sample is a child process (this script with --child) that imports shardlm from one tree, builds rank 0 of
the bundled model's one-rank plan as a rank builds it, and times a SlotRunner with no engine, driver or queue
around it (with the rank's malloc settings, where the tree has them, and the environment a rank of this tree starts
with: malloc on huge pages unless SHARDLM_HUGE_PAGES=0): `--steps` decode steps of the case's batch
(contexts 8-135, cycling, as in a 128-token generate) and a 512-token prefill (its speed and its minor page faults,
the median of the second and third runs). A case is DTYPE:BATCH with DTYPE f32, bf16, int8 or int4 (int8/int4 with
the int8 embedding).
Trees alternate within each round. It resolves a few percent where `bench/decode.py`, whose samples include the
engine and are far apart in time, cannot; this VM's read bandwidth swings within minutes, so compare the rounds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
PROMPT = (1, 504, 3458, 282, 260, 9193, 2377, 5981)
"""Eight token ids of the bundled model's vocabulary: every row's prompt."""


def one_rank_runner(fmt: str, slots: int):
    """Rank 0 of the bundled model's one-rank plan as a rank builds it (its malloc settings first, where the tree has
    them), in a SlotRunner with no engine: `fmt` f32, bf16, int8 or int4 (int8/int4 with the int8 embedding),
    `slots` KV-cache slots of 1024 tokens. Threads: the machine's cores. Uses the shardlm on sys.path."""
    import torch

    from shardlm.bundled import default_model_dir
    from shardlm.engine.session import model_ref
    from shardlm.models.source import ModelSource
    from shardlm.parallel.context import ParallelContext
    from shardlm.plan.plan import KVBudget
    from shardlm.plan.run import RunFlags, plan_for_run
    from shardlm.runtime import worker
    from shardlm.runtime.build import build_rank_model
    from shardlm.runtime.serve_step import SlotRunner

    if hasattr(worker, "set_malloc"):  # as a rank does first (trees before it left glibc's thresholds moving)
        worker.set_malloc(False)
    quant = fmt if fmt in ("int8", "int4") else "none"
    flags = RunFlags(dtype="bfloat16" if fmt == "bf16" else "float32", quantization=quant,
                     quantize_embedding=quant != "none")
    torch.set_num_threads(os.cpu_count() or 1)
    source = ModelSource.open(str(default_model_dir(progress=False)))
    plan = plan_for_run(model_ref(source), source.family, source.args, flags, KVBudget(max(slots, 2), 1024, 512))
    return SlotRunner(build_rank_model(plan.rank_spec(0), source, ParallelContext(), None, "cpu"), ParallelContext())


def child(case: str, steps: int) -> dict:
    """In the child: decode ms a step and 512-token prefill tok/s for `case`, with the shardlm on PYTHONPATH."""
    from shardlm.runtime.protocol import SamplingParams
    from shardlm.runtime.work import Decode, Prefill, SlotStart, Step

    fmt, batch = case.split(":")
    batch = int(batch)
    runner = one_rank_runner(fmt, batch)
    greedy = SamplingParams()
    runner.run(Step(0, tuple(SlotStart(s, 0) for s in range(batch)),
                    tuple(Prefill(s, PROMPT, 0, True, greedy) for s in range(batch)), ()))
    pos = len(PROMPT)

    def decode_steps(n: int, first_id: int) -> float:
        nonlocal pos
        t0 = time.perf_counter()
        for i in range(n):
            runner.run(Step(first_id + i, (), (), tuple(Decode(s, 5, pos, greedy) for s in range(batch))))
            pos = pos + 1 if pos < 135 else len(PROMPT)
        return (time.perf_counter() - t0) / n

    decode_steps(10, 1)  # warm-up
    step_s = decode_steps(steps, 100)
    prompt = tuple((i * 7919) % 40000 + 10 for i in range(512))
    rates, faults = [], []
    for i in range(3):
        t0, f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        runner.run(Step(10_000 + i, (SlotStart(0, 0),), (Prefill(0, prompt, 0, True, greedy),), ()))
        rates.append(len(prompt) / (time.perf_counter() - t0))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)  # minor page faults of the prefill
    return {"step_ms": step_s * 1e3, "prefill_tok_s": statistics.median(rates[1:]),
            "prefill_faults": statistics.median(faults[1:])}


def sample(tree: Path, case: str, steps: int) -> dict:
    """One child run of `case` with `tree`'s shardlm."""
    from decode_common import rank_env

    env = rank_env(PYTHONPATH=str(tree / "src"))  # this tree's rank environment for both trees
    res = subprocess.run([sys.executable, __file__, "--child", case, "--steps", str(steps)], capture_output=True,
                         text=True, timeout=900, env=env, cwd=tree)
    if res.returncode != 0:
        raise RuntimeError(f"{tree}: case {case} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def report(got: dict, args, started: str) -> str:
    """The RESULTS.md section: per case, each round's step time for both trees, and the medians' ratio."""
    import decode as _decode

    info = _decode.machine_info()
    lines = [heading(args.commit), "",
             f"Command: `python bench/step_vs_commit.py --commit {args.commit} --rounds {args.rounds} --cases "
             f"{args.cases} --steps {args.steps}`. Date: {started}. Machine: {info['cpu']}, {info['cores']} cores, "
             f"{info['ram']}; torch {info['torch']}. Rank 0 of the bundled model's one-rank plan, in-process "
             "SlotRunner (no engine), decode contexts 8-135; trees alternate within each round.", "",
             f"| case | decode ms a step, this tree (rounds) | {args.commit} (rounds) | this / {args.commit} | "
             f"prefill 512 tok/s, this tree / {args.commit} | prefill page faults, this tree / {args.commit} |",
             "|---|---|---|---|---|---|"]
    for case in args.cases.split(","):
        new, old = got[("this tree", case)], got[(args.commit, case)]
        n_ms, o_ms = [x["step_ms"] for x in new], [x["step_ms"] for x in old]
        lines.append(f"| {case} | {' / '.join(f'{v:.2f}' for v in n_ms)} | {' / '.join(f'{v:.2f}' for v in o_ms)} | "
                     f"{statistics.median(n_ms) / statistics.median(o_ms):.3f} | "
                     f"{statistics.median(x['prefill_tok_s'] for x in new):.0f} / "
                     f"{statistics.median(x['prefill_tok_s'] for x in old):.0f} | "
                     f"{statistics.median(x['prefill_faults'] for x in new):.0f} / "
                     f"{statistics.median(x['prefill_faults'] for x in old):.0f} |")
    return "\n".join(lines) + "\n"


def heading(commit: str) -> str:
    """This benchmark's RESULTS.md heading (one section per commit)."""
    return f"## Rank step in-process: this tree vs {commit} (bench/step_vs_commit.py)"


def main() -> None:
    """Measure both trees, print, and (unless --no-write) record the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default="095f1fe")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="f32:1,f32:16,int4:1")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    sys.path.insert(0, str(BENCH))  # the parent only: a child imports shardlm from the tree it measures
    import decode as _decode
    from decode_vs_commit import ROOT, worktree

    started, t0 = dt.datetime.now().strftime("%Y-%m-%d %H:%M"), time.monotonic()
    trees = {"this tree": ROOT, args.commit: worktree(args.commit)}
    got: dict = {}
    for r in range(args.rounds):
        for case in args.cases.split(","):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                got.setdefault((name, case), []).append(s := sample(trees[name], case, args.steps))
                print(f"round {r + 1} {name} {case}: {s['step_ms']:.2f} ms a step, prefill "
                      f"{s['prefill_tok_s']:.0f} tok/s, {s['prefill_faults']:.0f} page faults", flush=True)
    text = report(got, args, started)
    print(text + f"\n{(time.monotonic() - t0) / 60:.1f} min")
    if not args.no_write:
        _decode.write_section(text, heading(args.commit))


if __name__ == "__main__":
    main()
