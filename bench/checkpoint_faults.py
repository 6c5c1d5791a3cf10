"""SIGKILL every write command at random moments and count what it leaves behind (target: nothing partial).

    python bench/checkpoint_faults.py [--trials 20] [--mb 120] [--seed 0] [--no-write]

For each of `shard`, `reshard`, `consolidate` and `convert` (as a user runs them, `python -m shardlm`),
on a random-weight Llama of about --mb MB: --trials runs, each SIGKILLed at a random moment, three in
four while it writes its output (uniform over the write, from the moment its build folder appears)
and one in four anywhere in the run (start-up and the check before use included). Even trials write
a new folder without --overwrite (the previous trial's output, if complete, is removed first; a
killed run must leave nothing that makes this rerun refuse); odd trials replace a complete checkpoint
with --overwrite (the old one must survive the kill untouched, or the new one be complete).

After each kill the output is classified: none (no folder), old (the previous checkpoint, verify
passes), new (a complete new one, verify passes), partial (anything else: the failure counted).
Also counted: reruns refused, build folders left beside the output after each kill (swept by the
next run), and any left after one final clean run (target 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as _decode  # noqa: E402

from shardlm.checkpoint.output import stale_siblings  # noqa: E402
from shardlm.checkpoint.verify import verify  # noqa: E402
from shardlm.models.presets import PRESETS  # noqa: E402
from shardlm.models.random import write_random_checkpoint  # noqa: E402

HEADING = "## SIGKILL during checkpoint writes (bench/checkpoint_faults.py)"
SHARDLM = [sys.executable, "-m", "shardlm"]


def medium_config(mb: float) -> dict:
    """A Llama config of about `mb` MB in float32 (hidden 512, 8 heads, 4 KV heads, vocab 16000)."""
    per_layer = 4 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 2048)
    layers = max(2, round((mb * 1e6 - 4 * 2 * 16000 * 512) / per_layer))
    return {**PRESETS["debug"], "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": layers,
            "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 16000}


def _manifest(model: Path, tmp: Path, tp: int) -> Path:
    path = tmp / f"tp{tp}.yaml"
    subprocess.run(SHARDLM + ["plan", str(model), "--devices", f"{tp}xcpu-4GB", "--tp", str(tp), "--pp", "1",
                              "--dtype", "float32", "-o", str(path)], check=True, capture_output=True)
    return path


def _building(out: Path, pid: int) -> bool:
    prefix = f".{out.name}.shardlm-tmp-{pid}-"
    return any(p.name.startswith(prefix) for p in out.parent.iterdir())


def _run_and_kill(cmd: list[str], out: Path, delay: float, after_build: bool) -> int | None:
    """Start `cmd`; SIGKILL it `delay` s after its build folder appears (or after start); its exit code if it ended first."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    if after_build:
        while not _building(out, proc.pid) and proc.poll() is None and time.monotonic() - t0 < 120:
            time.sleep(0.002)
        t0 = time.monotonic()
    while time.monotonic() - t0 < delay and proc.poll() is None:
        time.sleep(0.002)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return proc.returncode


def _classify(out: Path, old_inode: int | None) -> str:
    if not out.exists():
        return "none"
    if not verify(out, checksums=False).ok:
        return "partial"
    same = old_inode is not None and (out / "config.json").stat().st_ino == old_inode
    return "old" if same else "new"


def _place_old(reference: Path, out: Path) -> int:
    """Put a complete checkpoint at `out` (hard links to `reference`); returns config.json's inode."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(reference, out, copy_function=os.link)
    return (out / "config.json").stat().st_ino


def trials(name: str, cmd: list[str], out: Path, reference: Path, n: int, rng: random.Random, timing: dict) -> dict:
    """`n` kill trials of one command; returns the counts."""
    counts = {"trials": n, "none": 0, "old": 0, "new": 0, "partial": 0, "finished": 0, "refused": 0, "left": 0}
    for i in range(n):
        fresh = i % 2 == 0
        old_inode = None
        if fresh:
            if out.exists() and verify(out, checksums=False).ok:
                shutil.rmtree(out)  # a complete previous result: the user would pick a new name or remove it
        else:
            old_inode = _place_old(reference, out)
        after_build = rng.random() < 0.75
        span = timing["write"] if after_build else timing["total"]
        code = _run_and_kill(cmd + ["-o", str(out)] + ([] if fresh else ["--overwrite"]), out,
                             rng.uniform(0, span * 1.1), after_build)
        counts["finished"] += code == 0
        counts["refused"] += code == 2
        counts[_classify(out, old_inode)] += 1
        counts["left"] += len(stale_siblings(out))
        print(f"  {name} trial {i}: {'fresh' if fresh else 'overwrite'}, exit {code}, {_classify(out, old_inode)}, "
              f"{len(stale_siblings(out))} build folders beside it", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(cmd + ["-o", str(out)], check=True, capture_output=True)
    counts["after_clean_run"] = len(stale_siblings(out))
    return counts


def _timing(cmd: list[str], out: Path) -> dict:
    """Seconds of a clean run: in total, and from its build folder appearing to its end."""
    proc = subprocess.Popen(cmd + ["-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    tb = None
    while proc.poll() is None:
        if tb is None and _building(out, proc.pid):
            tb = time.monotonic()
        time.sleep(0.002)
    end = time.monotonic()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed")
    return {"total": end - t0, "write": end - (tb or t0)}


def main() -> None:
    """Run the trials, print, and (unless --no-write) replace this benchmark's RESULTS.md section."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--mb", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true")
    opts = ap.parse_args()
    rng = random.Random(opts.seed)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="faults-bench-") as tmp:
        tmp = Path(tmp)
        os.environ["SHARDLM_HOME"] = str(tmp / "home")  # its record of verified files, not the user's
        model = write_random_checkpoint(medium_config(opts.mb), tmp / "model", seed=1)
        tp2, tp3 = _manifest(model, tmp, 2), _manifest(model, tmp, 3)
        ranks = tmp / "ranks"
        subprocess.run(SHARDLM + ["shard", str(model), "--manifest", str(tp2), "-o", str(ranks)], check=True,
                       capture_output=True)
        cmds = {"shard": SHARDLM + ["shard", str(model), "--manifest", str(tp3), "--max-shard-size", "8MB"],
                "reshard": SHARDLM + ["reshard", str(ranks), "--manifest", str(tp3), "--max-shard-size", "8MB"],
                "consolidate": SHARDLM + ["consolidate", str(ranks), "--max-shard-size", "8MB"],
                "convert": SHARDLM + ["convert", str(model), "--max-shard-size", "8MB"]}
        for name, cmd in cmds.items():
            reference = tmp / f"{name}-reference"
            timing = _timing(cmd, reference)
            print(f"{name}: clean run {timing['total']:.1f} s, writing {timing['write']:.1f} s", flush=True)
            rows[name] = {**trials(name, cmd, tmp / f"{name}-out", reference, opts.trials, rng, timing), **timing}
    text = report(rows, opts)
    print(text)
    if not opts.no_write:
        _decode.write_section(text, HEADING)


def report(rows: dict, opts) -> str:
    """The RESULTS.md section."""
    info = _decode.machine_info()
    cols = ["trials", "none", "old", "new", "partial", "finished", "refused", "left", "after_clean_run"]
    lines = [HEADING, "",
             f"Run {dt.datetime.now().isoformat(timespec='minutes')} with `python bench/checkpoint_faults.py --trials "
             f"{opts.trials} --mb {opts.mb:g} --seed {opts.seed}`; machine: {info['cpu']}, {info['cores']} cores, "
             f"{info['ram']}, torch {info['torch']}; {_decode.uptime()}.", "",
             "| command | clean run | writing | " + " | ".join(cols) + " |", "|---|---:|---:|" + "---:|" * len(cols)]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['total']:.1f} s | {r['write']:.1f} s | " + " | ".join(str(r[c]) for c in cols) + " |")
    lines += ["", "none: no output folder after the kill; old: the replaced checkpoint survived untouched; new: the run "
              "committed before the kill; partial: an output folder that does not verify (target 0); finished: runs "
              "that ended before the kill came; refused: reruns refused (target 0); left: build folders beside the "
              "output right after the kills (each swept by the next run); after_clean_run: build folders left once "
              "one run completes (target 0).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
