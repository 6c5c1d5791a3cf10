"""Decode speed with layers streamed from disk: shardlm (prefetch on/off) vs Accelerate's disk offload.

    python bench/offload.py [--budget-mb 128] [--new 24] [--rounds 3] [--no-write]

The bundled SmolLM2-135M (float32, 513 MB) under a per-process weight budget, batch 1, greedy:
  shardlm:               `shardlm generate --memory-budget B --offload-dir D` (prefetch on)
  shardlm, no prefetch:  the same with --no-prefetch
  accelerate:            transformers `from_pretrained(device_map="auto", max_memory={"cpu": B},
                         offload_folder=D)`, the layers that do not fit memory-mapped from D
Decode tok/s = (new - 1) tokens over the time from the first to the last new token (shardlm: the rank's
decode_s; accelerate: a LogitsProcessor stamping each step). Floor = bytes shardlm streams per token
/ the sequential read bandwidth of D with a warm page cache (the scratch file is far smaller than
RAM, so after the first step every read is served from the page cache, for both systems), and
with the cache dropped, for reference. Needs `pip install accelerate` (not a shardlm dependency).
Results replace this benchmark's section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as _decode  # noqa: E402
from checkpoint_load import disk_bandwidth  # noqa: E402

from shardlm.bundled import default_model_dir  # noqa: E402

HEADING = "## Disk offload: shardlm vs Accelerate (bench/offload.py)"
PROMPT = [1, 504, 3575, 282, 4649, 314]

ACCEL = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM, LogitsProcessorList
folder, budget, offload, new = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
torch.set_num_threads(int(sys.argv[5]))
m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="auto",
                                         max_memory={"cpu": budget}, offload_folder=offload)
placed = {}
for k, v in m.hf_device_map.items():
    placed[str(v)] = placed.get(str(v), 0) + 1
stamps = []
class Clock:
    def __call__(self, ids, scores):
        stamps.append(time.perf_counter())
        return scores
ids = torch.tensor([PROMPT])
with torch.inference_mode():
    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                     logits_processor=LogitsProcessorList([Clock()]), eos_token_id=None, pad_token_id=0)
print(json.dumps({"decode_s": stamps[-1] - stamps[0], "steps": len(stamps), "placed": placed,
                  "tokens": out[0, ids.shape[1]:].tolist()}))
""".replace("PROMPT", repr(PROMPT))


def shardlm_run(budget: int, offload: Path, new: int, prefetch: bool, uncached: bool = False) -> dict:
    """One `shardlm generate` with the budget; returns decode tok/s and the rank's streaming figures.
    `uncached` evicts each layer from the page cache after use (SHARDLM_OFFLOAD_UNCACHED=1)."""
    cmd = [sys.executable, "-m", "shardlm", "generate", "x", "--max-new-tokens", str(new), "--ignore-eos",
           "--memory-budget", f"{budget // 2**20}MB", "--offload-dir", str(offload), "--json"]
    cmd += [] if prefetch else ["--no-prefetch"]
    env = {**os.environ, "SHARDLM_OFFLOAD_UNCACHED": "1" if uncached else "0"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    out = json.loads(res.stdout)
    r = out["ranks"][0]
    return {"tok_s": out["timings"]["decode_tokens_per_s"], "per_step": r["streamed_bytes_per_step"],
            "hit_rate": r["prefetch_hit_rate"], "resident": r["resident_bytes"], "streamed_layers": len(r["streamed_layers"]),
            "peak_growth": r["peak_rss_bytes"] - r["rss_before_load_bytes"]}


def accelerate_run(folder: Path, budget: int, offload: Path, new: int, threads: int) -> dict:
    """One Accelerate disk-offload generate in a fresh process."""
    res = subprocess.run([sys.executable, "-c", ACCEL, str(folder), str(budget), str(offload), str(new), str(threads)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return {"tok_s": (out["steps"] - 1) / out["decode_s"], "placed": out["placed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mb", type=int, default=128)  # a quarter of the bundled model's 538 MB
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    opts = ap.parse_args()
    say = lambda m: print(m, flush=True)  # noqa: E731
    folder = default_model_dir(progress=False)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    budget = opts.budget_mb * 2**20
    work = Path(tempfile.mkdtemp(prefix="shardlm-offload-", dir=os.environ.get("TMPDIR", "/tmp")))
    threads = os.cpu_count() or 1
    try:
        bw = disk_bandwidth(work, mib=512)
        say(f"read bandwidth of {work}: warm {bw['warm']:.0f} MB/s, cold {bw['cold'] or 0:.0f} MB/s")
        systems = {
            "shardlm, prefetch": lambda: shardlm_run(budget, work / "s", opts.new, True),
            "shardlm, no prefetch": lambda: shardlm_run(budget, work / "s", opts.new, False),
            "accelerate disk offload": lambda: accelerate_run(folder, budget, work / "a", opts.new, threads),
            "shardlm, prefetch, every read from disk": lambda: shardlm_run(budget, work / "s", opts.new, True, True),
            "shardlm, no prefetch, every read from disk": lambda: shardlm_run(budget, work / "s", opts.new, False, True),
        }
        samples: dict[str, list[dict]] = {k: [] for k in systems}
        keys = list(systems)
        for i in range(opts.rounds):
            for k in keys[i % len(keys):] + keys[:i % len(keys)]:
                samples[k].append(systems[k]())
                say(f"  round {i + 1}: {k} {samples[k][-1]['tok_s']:.2f} tok/s")
        text = report(samples, bw, budget, size, opts, threads)
        print(text)
        if not opts.no_write:
            _decode.write_section(text, HEADING)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(samples: dict, bw: dict, budget: int, size: int, opts, threads: int) -> str:
    """The RESULTS.md section."""
    info = _decode.machine_info()
    med = {k: statistics.median(s["tok_s"] for s in v) for k, v in samples.items()}
    ours = samples["shardlm, prefetch"][0]
    per_token = ours["per_step"]
    floor = bw["warm"] * 1e6 / per_token
    accel = med["accelerate disk offload"]
    lines = [HEADING, "",
             f"Run {dt.datetime.now().isoformat(timespec='minutes')} with `python bench/offload.py --budget-mb "
             f"{opts.budget_mb} --new {opts.new} --rounds {opts.rounds}`; machine: {info['cpu']}, {info['cores']} cores, "
             f"{info['ram']}, torch {info['torch']}, transformers {info['transformers']}. Bundled SmolLM2-135M float32 "
             f"({size / 1e6:.0f} MB of weights), batch 1, {opts.new} new tokens, budget {opts.budget_mb} MiB per process "
             f"({budget / size:.0%} of the weights), {threads} threads for each system. Median of {opts.rounds} rounds "
             "in rotating order.", "",
             "| system | decode tok/s (rounds) | vs accelerate |", "|---|---:|---:|"]
    for k, v in samples.items():
        rounds = ", ".join(f"{s['tok_s']:.2f}" for s in v)
        lines.append(f"| {k} | {med[k]:.2f} ({rounds}) | {med[k] / accel:.1f}x |")
    lines += ["",
              f"shardlm kept {ours['resident'] / 2**20:.0f} MiB in its own memory (norms, resident layers; the "
              f"embedding/head is used in place from the mapped file when the budget cannot hold it) and streamed {ours['streamed_layers']} of 30 layers, {per_token / 1e6:.0f} MB per token; "
              f"prefetch hit rate {statistics.median(s['hit_rate'] for s in samples['shardlm, prefetch']):.0%}; peak RSS "
              f"grew {ours['peak_growth'] / 2**20:.0f} MiB during the run. Accelerate placed modules as "
              f"{samples['accelerate disk offload'][0]['placed']}.", "",
              f"Read bandwidth of the offload folder: {bw['warm']:.0f} MB/s with a warm page cache, "
              + (f"{bw['cold']:.0f} MB/s after dropping it" if bw["cold"] else "the cache could not be dropped")
              + f". The streamed file ({per_token / 1e6:.0f} MB) stays in the page cache after the first step, so the "
              f"floor uses the warm figure: {per_token / 1e6:.0f} MB / {bw['warm']:.0f} MB/s = **{floor:.1f} tok/s** "
              f"(the compute of the resident part not counted). shardlm with prefetch reaches "
              f"{med['shardlm, prefetch'] / floor:.0%} of it (target 60%) and {med['shardlm, prefetch'] / accel:.1f}x "
              "Accelerate (target 5x)."]
    if bw["cold"]:
        cold_floor = bw["cold"] * 1e6 / per_token
        lines += ["", "The last two rows evict each layer from the page cache after use (SHARDLM_OFFLOAD_UNCACHED=1), "
                  "so every step reads the disk, as for a model much larger than RAM. Their floor is the cold "
                  f"bandwidth: {per_token / 1e6:.0f} MB / {bw['cold']:.0f} MB/s = **{cold_floor:.1f} tok/s**; with "
                  f"prefetch shardlm reaches {med['shardlm, prefetch, every read from disk'] / cold_floor:.0%} of it, "
                  f"without {med['shardlm, no prefetch, every read from disk'] / cold_floor:.0%}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
