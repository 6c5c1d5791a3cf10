"""Start-up of this tree against an earlier commit, in one run: the time to a first token of a fresh command.

    python bench/startup_vs_commit.py [--commit HEAD~1] [--rounds 5] [--tp 1,2,4] [--big-gb 1.0] [--no-write]

Each sample is one `shardlm generate x --max-new-tokens 1 --json` run to its end, as a user types it: the
interpreter, the command line, the ranks' start (spawned, or forked from the fork server), their imports and
loading, one prefill and the exit, all included. The earlier commit is checked out once as a git worktree
(/tmp/shardlm-COMMIT, bench/decode_vs_commit.py) and run with the same interpreter, its own source first on
PYTHONPATH; both trees' kernels are compiled (one untimed run each) before anything is timed. Models: the bundled
SmolLM2-135M and, with --big-gb, a random-weight Llama of about that many GB (bench/checkpoint_load.py's). Rounds
alternate the trees' order; the table gives each case's median (min-max) and this tree / the earlier one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as _decode  # noqa: E402
from checkpoint_load import big_config, write_random_checkpoint  # noqa: E402
from decode_vs_commit import worktree  # noqa: E402

from shardlm.bundled import default_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Start-up: this tree vs an earlier commit (bench/startup_vs_commit.py)"


def first_token_s(tree: Path, model: Path, tp: int) -> float:
    """Wall seconds of `shardlm generate x --max-new-tokens 1` from `tree` on `model` at `tp`, start to exit."""
    cmd = [sys.executable, "-m", "shardlm", "generate", "x", "--model", str(model), "--tp", str(tp),
           "--max-new-tokens", "1", "--json"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree / "src")})
    if res.returncode != 0:
        raise RuntimeError(f"{tree}: generate --tp {tp} on {model} failed:\n{res.stderr[-3000:]}")
    return time.perf_counter() - t0


def measure(trees: dict[str, Path], models: dict[str, Path], tps: list[int], rounds: int) -> dict:
    """(tree name, model name, tp) -> seconds, one a round; the trees' order rotates every round."""
    got: dict = {}
    names = list(trees)
    for r in range(rounds):
        for model, folder in models.items():
            for tp in tps:
                for name in names[r % len(names):] + names[:r % len(names)]:
                    got.setdefault((name, model, tp), []).append(first_token_s(trees[name], folder, tp))
        print(f"round {r + 1} of {rounds} done", flush=True)
    return got


def table(got: dict, commit: str, models: list[str], tps: list[int]) -> list[str]:
    """The comparison's markdown rows: a model and tp a row."""
    lines = [f"| model | tp | this tree, s | {commit}, s | ratio |", "|---|---|---|---|---|"]
    for model in models:
        for tp in tps:
            new, old = got[("this tree", model, tp)], got[(commit, model, tp)]
            lines.append(f"| {model} | {tp} | {_cell(new)} | {_cell(old)} | "
                         f"{statistics.median(new) / statistics.median(old):.2f}x |")
    return lines


def _cell(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    """Measure both trees, print, and (unless --no-write) record the comparison in bench/RESULTS.md."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default="HEAD~1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", default="1,2,4", help="comma-separated tensor-parallel degrees")
    ap.add_argument("--big-gb", type=float, default=1.0, help="also a random Llama of about this size; 0: none")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    tps = [int(t) for t in args.tp.split(",")]
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.commit], capture_output=True,
                            text=True, check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="shardlm-startup-"))
    try:
        models = {"SmolLM2-135M (bundled)": default_model_dir(progress=False)}
        if args.big_gb > 0:
            big = write_random_checkpoint(big_config(args.big_gb), work / "big")
            for f in models["SmolLM2-135M (bundled)"].iterdir():  # a tokenizer for the prompt
                if f.name.startswith(("tokenizer", "special_tokens")):
                    shutil.copy(f, big / f.name)
            models[f"random Llama {args.big_gb:g} GB"] = big
        trees = {"this tree": ROOT, commit: worktree(commit)}
        for tree in trees.values():  # each tree's kernels compiled, the page cache warm
            for folder in models.values():
                first_token_s(tree, folder, 1)
        got = measure(trees, models, tps, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = _decode.machine_info()
    text = "\n".join([HEADING, "", f"Command: `python bench/startup_vs_commit.py --commit {commit} --rounds "
                      f"{args.rounds} --tp {args.tp} --big-gb {args.big_gb:g}`. Date: {started}. "
                      f"Machine: {info['cpu']}, {info['cores']} cores, {info['ram']}; torch {info['torch']}. Seconds from the command's start "
                      "to its exit, one token generated, page cache warm; median over rounds (min-max).", "",
                      *table(got, commit, list(models), tps)]) + "\n"
    print(text)
    if not args.no_write:
        _decode.write_section(text, HEADING)


if __name__ == "__main__":
    main()
