"""Peak memory of shard, reshard and consolidate on a checkpoint larger than half this machine's RAM.

    python bench/shard_memory.py [--gb 13] [--max-shard-size 2GB] [--no-write]

Writes a random-weight Llama of about --gb GB (float32, streamed, 2 GB files), then runs as fresh
commands, each watched every 20 ms through /proc/PID/status:
  shardlm shard MODEL --manifest tp2.yaml        (ordinary -> tp 2)
  shardlm reshard TP2 --manifest tp3x... .yaml   (tp 2 -> tp 3)
  shardlm consolidate TP3                        (tp 3 -> one ordinary checkpoint)
Reports peak anonymous RSS (the process's own memory: tensors, Python, torch) and peak file-backed
RSS (pages of mmap'ed safetensors files, which the kernel can drop at any time) against the
largest tensor and the output shard cap. The claim under test: peak memory stays near the largest
tensor plus one output shard, not near the model. Results replace this benchmark's section of
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as _decode  # noqa: E402
from checkpoint_load import big_config  # noqa: E402

from shardlm.checkpoint.readers import open_reader  # noqa: E402
from shardlm.models.random import write_random_checkpoint  # noqa: E402
from shardlm.hardware import parse_size  # noqa: E402

HEADING = "## Sharder memory on a checkpoint larger than half the RAM (bench/shard_memory.py)"
SHARDLM = [sys.executable, "-m", "shardlm"]
GiB = 2**30


def status_kb(pid: int) -> dict[str, int]:
    """RssAnon, RssFile and VmHWM of `pid` in KiB (empty once it is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def watched(cmd: list[str]) -> dict:
    """Run `cmd`, sampling its memory every 20 ms; returns peaks (bytes), seconds and its --json output."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"RssAnon": 0, "RssFile": 0, "VmHWM": 0}
    while proc.poll() is None:
        for k, v in status_kb(proc.pid).items():
            peak[k] = max(peak[k], v)
        time.sleep(0.02)
    out, err = proc.communicate()
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return {"anon": peak["RssAnon"] * 1024, "file": peak["RssFile"] * 1024, "hwm": peak["VmHWM"] * 1024,
            "seconds": secs, "result": json.loads(out) if out.strip().startswith("{") else {}}


def folder_bytes(folder: Path) -> int:
    """Bytes of the .safetensors files under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=13.0)
    ap.add_argument("--max-shard-size", default="2GB")
    ap.add_argument("--no-write", action="store_true")
    opts = ap.parse_args()
    say = lambda m: print(m, flush=True)  # noqa: E731
    cap = parse_size(opts.max_shard_size)
    work = Path(tempfile.mkdtemp(prefix="shardlm-mem-", dir=os.environ.get("TMPDIR", "/tmp")))
    try:
        say(f"writing a random-weight Llama of about {opts.gb} GB (streamed) into {work}...")
        t0 = time.perf_counter()
        model = write_random_checkpoint(big_config(opts.gb), work / "model", max_shard_bytes=2 * GiB)
        say(f"  {folder_bytes(model) / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s")
        reader = open_reader(model)
        largest = max(math.prod(reader.shape(n)) * reader.dtype(n).itemsize for n in reader.names())
        reader.close()
        manifests = {}
        for name, devices, tp in (("tp2", "2xcpu-16GB", 2), ("tp3", "3xcpu-16GB", 3)):
            manifests[name] = work / f"{name}.yaml"
            subprocess.run(SHARDLM + ["plan", str(model), "--devices", devices, "--tp", str(tp), "--pp", "1",
                                      "--dtype", "float32", "-o", str(manifests[name])], check=True,
                           capture_output=True)
        size = ["--max-shard-size", opts.max_shard_size, "--json"]
        steps = [
            ("shard: ordinary -> tp 2", SHARDLM + ["shard", str(model), "--manifest", str(manifests["tp2"]),
                                                   "-o", str(work / "tp2"), *size], work / "tp2"),
            ("reshard: tp 2 -> tp 3", SHARDLM + ["reshard", str(work / "tp2"), "--manifest", str(manifests["tp3"]),
                                                 "-o", str(work / "tp3"), *size], work / "tp3"),
            ("consolidate: tp 3 -> ordinary", SHARDLM + ["consolidate", str(work / "tp3"), "-o", str(work / "hf"),
                                                         *size], work / "hf"),
        ]
        rows = []
        for i, (label, cmd, out) in enumerate(steps):
            say(f"{label}...")
            r = watched(cmd)
            r["bytes"] = folder_bytes(out)
            say(f"  {r['seconds']:.0f} s, anon peak {r['anon'] / GiB:.2f} GiB, file-backed peak {r['file'] / GiB:.2f} GiB")
            rows.append((label, r))
            if i == 1:  # keep the disk within bounds: tp 2 files are no longer needed
                shutil.rmtree(work / "tp2")
        text = report(rows, folder_bytes(model), largest, cap, opts)
        print(text)
        if not opts.no_write:
            _decode.write_section(text, HEADING)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(rows, model_bytes: int, largest: int, cap: int, opts) -> str:
    """The RESULTS.md section."""
    info = _decode.machine_info()
    bound = largest + cap
    lines = [HEADING, "",
             f"Run {dt.datetime.now().isoformat(timespec='minutes')} with `python bench/shard_memory.py --gb {opts.gb} "
             f"--max-shard-size {opts.max_shard_size}`; machine: {info['cpu']}, {info['cores']} cores, {info['ram']}, "
             f"torch {info['torch']}. Model: random-weight Llama, {model_bytes / 1e9:.1f} GB float32 in 2 GiB files; "
             f"largest tensor {largest / 2**20:.0f} MiB; output shard cap {cap / 2**20:.0f} MiB; "
             f"largest tensor + one output shard = {bound / GiB:.2f} GiB. Memory sampled every 20 ms from "
             "/proc/PID/status.", "",
             "| step | seconds | MB/s written | peak anonymous RSS | peak file-backed RSS | VmHWM (both) | "
             "anonymous peak / (largest tensor + shard cap) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, r in rows:
        lines.append(f"| {label} | {r['seconds']:.0f} | {r['bytes'] / 1e6 / r['seconds']:.0f} | "
                     f"{r['anon'] / GiB:.2f} GiB | {r['file'] / GiB:.2f} GiB | {r['hwm'] / GiB:.2f} GiB | "
                     f"{r['anon'] / bound:.2f} |")
    lines += ["", "Anonymous RSS is memory the process owns (a tensor being read, its converted copy, Python and "
              "torch, about 0.3 GiB at start-up). File-backed RSS counts pages of the memory-mapped input files "
              "while they are mapped; the kernel reclaims them under pressure without writing anything, so they "
              "do not limit the model size. Seconds include interpreter start-up and planning checks."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
