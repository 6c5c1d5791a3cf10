"""Decode speed of this tree against an earlier commit, in one run: did a change cost speed?

    python bench/decode_vs_commit.py [--commit 5ddb9e0] [--rounds 3] [--new-tokens 128]
                                     [--quantization none|int8|int4] [--ragged] [--no-write]

The earlier commit is checked out once as a git worktree (/tmp/shardlm-COMMIT) and run with the same
interpreter and packages, its own source first on PYTHONPATH. Each round runs, for both trees in a
rotating order, `shardlm generate --json --ignore-eos` at tp 1 and tp 2, batch 1 and batch 8, and keeps
the decode and prefill tokens/s the command itself reports (rank 0's clock, prefill excluded from decode).
With --ragged, prompt i is padded with RAGGED_WORDS * i filler words, so a batch's rows decode at very different
lengths (about 8 to 340 tokens at batch 8), as a server's running requests do.
Tables give the median over rounds and this tree / the earlier one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as _decode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The history of the printing press begins", "def merge_sort(items):", "The three laws of motion are",
           "Once upon a time in a quiet town", "The recipe calls for flour, eggs and", "In the year 1905, Einstein",
           "Photosynthesis converts light into", "A good night's sleep helps"]
CASES = [(tp, batch) for tp in (1, 2) for batch in (1, 8)]
RAGGED_WORDS = 48
"""Filler words per prompt index with --ragged."""


def prompts(batch: int, ragged: bool = False) -> list[str]:
    """The first `batch` prompts; with `ragged`, prompt i lengthened by RAGGED_WORDS * i words."""
    return [p + " and then" * (RAGGED_WORDS * i // 2) if ragged else p for i, p in enumerate(PROMPTS[:batch])]


def heading(commit: str, quantization: str = "none", ragged: bool = False) -> str:
    """This benchmark's RESULTS.md heading (one section per commit, quantization and prompt shape)."""
    what = ("" if quantization == "none" else f", {quantization}") + (", ragged prompts" if ragged else "")
    return f"## Decode after the engine rewrite: this tree vs {commit}{what} (bench/decode_vs_commit.py)"


def worktree(commit: str) -> Path:
    """A checkout of `commit` beside this one (made once)."""
    path = Path(f"/tmp/shardlm-{commit}")
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True)
    return path


def generate(tree: Path, tp: int, batch: int, new_tokens: int, quantization: str = "none",
             ragged: bool = False) -> dict:
    """`shardlm generate --json` from `tree`: its timings."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, "-m", "shardlm", "generate", *prompts(batch, ragged), "--tp", str(tp), "--max-new-tokens",
           str(new_tokens), "--ignore-eos", "--json", "--quantization", quantization]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tree)
    if res.returncode != 0:
        raise RuntimeError(f"{tree}: generate --tp {tp} with {batch} prompts failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout)["timings"]


def measure(trees: dict[str, Path], rounds: int, new_tokens: int, quantization: str = "none",
            ragged: bool = False) -> dict:
    """(tree name, tp, batch) -> list of (decode tok/s, prefill tok/s), one per round."""
    got: dict = {}
    names = list(trees)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for tp, batch in CASES:
            for name in order:
                t = generate(trees[name], tp, batch, new_tokens, quantization, ragged)
                got.setdefault((name, tp, batch), []).append((t["decode_tokens_per_s"], t["prefill_tokens_per_s"]))
                print(f"round {r + 1} {name} tp{tp} batch {batch}: decode {t['decode_tokens_per_s']:.1f} tok/s",
                      flush=True)
    return got


def report(got: dict, commit: str, args, started: str) -> str:
    """The RESULTS.md section."""
    info = _decode.machine_info()
    q_flag = ("" if args.quantization == "none" else f" --quantization {args.quantization}") + \
        (" --ragged" if args.ragged else "")
    lines = [heading(commit, args.quantization, args.ragged), "",
             f"Command: `python bench/decode_vs_commit.py --commit {commit} --rounds {args.rounds} --new-tokens "
             f"{args.new_tokens}{q_flag}`. Date: {started}. Machine: {info['cpu']}, {info['cores']} cores, {info['ram']}; "
             f"torch {info['torch']}. `shardlm generate --json --ignore-eos` of each tree, bundled model "
             f"({'float32' if args.quantization == 'none' else args.quantization + ' weights'}), "
             "median over rounds (min-max).", "",
             "| tp | batch | decode tok/s, this tree | decode tok/s, " + commit + " | ratio | prefill tok/s, this "
             "tree / " + commit + " |", "|---|---|---|---|---|---|"]
    for tp, batch in CASES:
        new, old = got[("this tree", tp, batch)], got[(commit, tp, batch)]
        d_new, d_old = [x[0] for x in new], [x[0] for x in old]
        p_new, p_old = statistics.median(x[1] for x in new), statistics.median(x[1] for x in old)
        lines.append(f"| {tp} | {batch} | {_cell(d_new)} | {_cell(d_old)} | "
                     f"{statistics.median(d_new) / statistics.median(d_old):.2f}x | {p_new:.0f} / {p_old:.0f} |")
    return "\n".join(lines) + "\n"


def _cell(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> None:
    """Measure both trees, print, and (unless --no-write) record the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default="5ddb9e0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    ap.add_argument("--ragged", action="store_true", help="prompts of very different lengths in a batch")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    started, t0 = dt.datetime.now().strftime("%Y-%m-%d %H:%M"), time.monotonic()
    trees = {"this tree": ROOT, args.commit: worktree(args.commit)}
    for tree in trees.values():  # compile each tree's kernels before anything is timed
        generate(tree, 1, 1, 4, args.quantization)
    got = measure(trees, args.rounds, args.new_tokens, args.quantization, args.ragged)
    text = report(got, args.commit, args, started)
    print(text + f"\n{(time.monotonic() - t0) / 60:.1f} min")
    if not args.no_write:
        _decode.write_section(text, heading(args.commit, args.quantization, args.ragged))


if __name__ == "__main__":
    main()
