"""Loading from per-rank files vs slicing vs transformers, and shard/reshard throughput vs the disk.

    python bench/checkpoint_load.py [--rounds N] [--big-gb 3] [--no-write]

Time to first token at tp 2, each as a fresh command (Python and torch start-up included for all):
  (a) `shardlm generate --tp 2 --max-new-tokens 1` on the ordinary checkpoint (each rank slices it),
  (b) the same on per-rank files written by `shardlm shard` for that plan,
  (c) transformers: `AutoModelForCausalLM.from_pretrained` + `generate(max_new_tokens=1)` in one process.
On the bundled SmolLM2-135M (float32) and on a random-weight Llama of about --big-gb GB (float32),
page cache warm (every system runs once before the timed rounds), systems in rotating order.
Also: MB/s of `shardlm shard` (ordinary -> tp 2) and `reshard` (tp 2 -> tp 3) against this disk's
sequential read bandwidth (a 1 GB file read after dropping the page cache, when this user may) and
its fsync'd write bandwidth.
Target: (b) <= 0.5 x (c). Results replace this benchmark's section of bench/RESULTS.md.
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

from shardlm.bundled import default_model_dir  # noqa: E402
from shardlm.checkpoint.shard import shard  # noqa: E402
from shardlm.models.presets import PRESETS  # noqa: E402
from shardlm.models.random import write_random_checkpoint  # noqa: E402

HEADING = "## Checkpoint loading and sharding (bench/checkpoint_load.py)"
PY = sys.executable
HF_SCRIPT = ("import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
             "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32); "
             "ids = torch.tensor([[1, 450, 7483, 310, 3444, 338]]); "
             "m.generate(ids, max_new_tokens=1, do_sample=False)")


def big_config(gb: float) -> dict:
    """A Llama config of about `gb` GB in float32 (hidden 2048, 32 heads, 8 KV heads)."""
    per_layer = 4 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 5632)
    embed = 4 * 2 * 32000 * 2048
    layers = max(2, round((gb * 1e9 - embed) / per_layer))
    return {**PRESETS["debug"], "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": layers,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 2048}


def timed(cmd: list[str]) -> float:
    """Wall seconds of a command run to completion; raises if it fails."""
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return time.perf_counter() - t0


def drop_cache() -> bool:
    """Drop the page cache if this user may (root); False otherwise."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def disk_bandwidth(folder: Path, mib: int = 1024) -> dict[str, float | None]:
    """MB/s of a `mib` MiB file in `folder`: sequential write (fsync'd), sequential read with the page
    cache warm (median of 5), and with it dropped ("cold": None when this user may not drop it)."""
    path = folder / "bw.bin"
    chunk = os.urandom(16 * 2**20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(mib // 16):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write = mib * 2**20 / 1e6 / (time.perf_counter() - t0)

    def read() -> float:
        buf = bytearray(16 * 2**20)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        return mib * 2**20 / 1e6 / (time.perf_counter() - t0)

    read()
    warm = statistics.median(read() for _ in range(5))
    cold = read() if drop_cache() else None
    path.unlink()
    return {"write": write, "warm": warm, "cold": cold}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big-gb", type=float, default=3.0)
    ap.add_argument("--no-write", action="store_true")
    opts = ap.parse_args()
    say = lambda m: print(m, flush=True)  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="shardlm-bench-", dir=os.environ.get("TMPDIR", "/tmp")))
    try:
        models = {"SmolLM2-135M (bundled)": default_model_dir(progress=False)}
        say(f"writing a random-weight Llama of about {opts.big_gb} GB...")
        big = write_random_checkpoint(big_config(opts.big_gb), work / "big")
        for f in models["SmolLM2-135M (bundled)"].iterdir():  # a tokenizer for the prompt (ids < 32000)
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, big / f.name)
        models[f"random Llama {opts.big_gb:.0f} GB"] = big
        bw = disk_bandwidth(work)
        write, disk, cold = bw["write"], bw["cold"] or bw["warm"], bw["cold"] is not None
        rows = []
        for label, folder in models.items():
            ranks2 = work / f"{folder.name}-tp2"
            s = shard(folder, ranks2, 2, (), 2 * 2**30, progress=False)
            r = shard(ranks2, work / f"{folder.name}-tp3", 2 + 1, (), 2 * 2**30, progress=False)
            shutil.rmtree(work / f"{folder.name}-tp3")
            systems = {
                "(a) slice HF checkpoint": [PY, "-m", "shardlm", "generate", "x", "--model", str(folder), "--tp", "2",
                                            "--max-new-tokens", "1", "--json"],
                "(b) per-rank files": [PY, "-m", "shardlm", "generate", "x", "--model", str(ranks2), "--tp", "2",
                                       "--max-new-tokens", "1", "--json"],
                "(c) transformers": [PY, "-c", HF_SCRIPT, str(folder)],
            }
            for cmd in systems.values():
                timed(cmd)  # warm the page cache and any one-off compile
            samples = {k: [] for k in systems}
            keys = list(systems)
            for i in range(opts.rounds):
                for k in keys[i % 3:] + keys[:i % 3]:
                    samples[k].append(timed(systems[k]))
                    say(f"  {label}: {k} {samples[k][-1]:.2f} s")
            med = {k: statistics.median(v) for k, v in samples.items()}
            rows.append((label, med, samples, s, r))
        text = report(rows, disk, write, cold, opts)
        print(text)
        if not opts.no_write:
            _decode.write_section(text, HEADING)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(rows, disk: float, write: float, cold: bool, opts) -> str:
    """The RESULTS.md section."""
    info = _decode.machine_info()
    lines = [HEADING, "",
             f"Run {dt.datetime.now().isoformat(timespec='minutes')} with `python bench/checkpoint_load.py --rounds "
             f"{opts.rounds} --big-gb {opts.big_gb}`; machine: {info['cpu']}, {info['cores']} cores, {info['ram']}, "
             f"torch {info['torch']}, transformers {info['transformers']}. Time to first token of a fresh command "
             "(interpreter and torch start-up included for every system), page cache warm, median of "
             f"{opts.rounds} rounds in rotating order. Disk sequential read: {disk:.0f} MB/s "
             f"({'page cache dropped' if cold else 'page cache could not be dropped'}); sequential write, fsync'd: "
             f"{write:.0f} MB/s.", "",
             "| model | (a) slice HF ckpt, tp 2 | (b) per-rank files, tp 2 | (c) transformers | (b)/(c) | "
             "shard MB/s | reshard MB/s |", "|---|---:|---:|---:|---:|---:|---:|"]
    rate = lambda v: f"{v:.0f} ({v / disk:.1f}x read, {v / write:.1f}x write)"  # noqa: E731
    for label, med, samples, s, r in rows:
        cell = lambda k: f"{med[k]:.2f} s ({min(samples[k]):.2f}-{max(samples[k]):.2f})"  # noqa: E731
        a, b, c = (k for k in med)
        lines.append(f"| {label} | {cell(a)} | {cell(b)} | {cell(c)} | {med[b] / med[c]:.2f} | "
                     f"{rate(s.mb_per_s)} | {rate(r.mb_per_s)} |")
    lines += ["", "shard/reshard MB/s count bytes written (the data read is the same size), each file fsync'd and "
              "checksummed (sha256) before its rename; the source is in the page cache, so the disk's write "
              "bandwidth is their ceiling."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
