"""Pipeline throughput: pp 2 with and without micro-batching, and tp 2, against tp 1, in one run.

    python bench/pipeline.py [--rounds N] [--new-tokens N] [--no-write]

Workload: the bundled SmolLM2-135M-Instruct (float32, 30 layers, stages 15/15), a batch of 8 prompts
of 40 tokens, 64 new tokens each with end-of-sequence disabled, greedy. Every system is a LocalEngine
started once and kept; systems run in a rotating order each round, after the other processes on the
host leave the cores nearly idle (bench/decode.py's QuietGate). Ranks share this machine's cores
(cores // ranks threads each).

Measured per system: batch throughput (8 x 64 new tokens / wall time of the generate call, prefill
included), decode tokens/s and prefill tokens/s as the runtime reports them, and, per rank, the
seconds spent inside send and recv. Separately, a ping-pong over gloo between two spawned ranks
gives the cost of one point-to-point message of each size the pipeline sends. The table of results
and the explanation against the bubble model replace this benchmark's section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as _decode  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardlm.bundled import default_model_dir  # noqa: E402
from shardlm.models.args import read_config  # noqa: E402
from shardlm.models.registry import args_for_config  # noqa: E402
from shardlm.parallel.launch import run_on_ranks  # noqa: E402
from shardlm.engine import LocalEngine  # noqa: E402
from shardlm.engine.session import plan_run  # noqa: E402
from shardlm.engine.text import load_tokenizer, pad_id  # noqa: E402
from shardlm.plan.plan import KVBudget  # noqa: E402
from shardlm.plan.run import RunFlags  # noqa: E402
from shardlm.runtime.protocol import SamplingParams  # noqa: E402

HEADING = "## Pipeline parallelism: batch throughput (bench/pipeline.py)"
BATCH, PROMPT_LEN = 8, 40
# label -> (tp, stage layer ranges, micro-batches, torch threads per rank or None for cores // ranks)
HALVES = ((0, 15), (15, 30))
SYSTEMS = {
    "tp 1": (1, (), 1, None),
    "tp 1, 1 thread": (1, (), 1, 1),
    "tp 2": (2, (), 1, None),
    "pp 2, m 1": (1, HALVES, 1, None),
    "pp 2, m 2 (auto)": (1, HALVES, 2, None),
    "pp 2, m 4": (1, HALVES, 4, None),
    "pp 2, m 8": (1, HALVES, 8, None),
}


def _pingpong(rank: int, world: int, sizes: list[int], iters: int) -> dict[int, float]:
    """Median seconds of one message (half a round trip) for each float32 element count."""
    out = {}
    for n in sizes:
        t = torch.zeros(n)
        samples = []
        for i in range(iters + 5):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            if i >= 5:
                samples.append((time.perf_counter() - t0) / 2)
        out[n] = statistics.median(samples)
    return out


def measure_p2p(dim: int) -> dict[str, tuple[int, float]]:
    """Cost of each message kind the pp 2 pipeline sends, measured by ping-pong: name -> (bytes, seconds)."""
    kinds = {
        "header (2 int64)": 4,  # 16 bytes, timed as 4 float32
        "decode hidden, m 1 (8 rows)": BATCH * dim,
        "decode hidden, m 4 (2 rows)": 2 * dim,
        "prefill hidden, m 1 (8 x 40 rows)": BATCH * PROMPT_LEN * dim,
    }
    sizes = list(kinds.values())
    res = run_on_ranks(_pingpong, 2, sizes, 200, timeout_s=120, threads=1)[0]
    return {k: (n * 4, res[n]) for k, n in zip(kinds, sizes)}


def _plan(folder: Path, tp: int, stages: tuple, m: int):
    """The plan and model of one system: its stages and micro-batches (the planner's default for pp 2 is 2)."""
    counts = tuple(b - a for a, b in stages) if stages else None
    flags = RunFlags(tp=tp, pp=len(stages) or 1, layers=counts, micro_batches=m if counts else None)
    return plan_run(str(folder), flags, KVBudget(BATCH, PROMPT_LEN + 128, PROMPT_LEN))


def run_round(engines: dict, order: list[str], work, new: int, gate, pad: int, say) -> dict[str, dict]:
    """One generate per system (in `order`); returns per-system measurements."""
    out = {}
    for label in order:
        eng = engines[label]
        before = eng.last_comms

        def call(eng=eng, label=label):
            t0 = time.perf_counter()
            res = eng.generate(work, new, SamplingParams(), pad, ignore_eos=True)
            return time.perf_counter() - t0, res
        foreign, (wall, res) = gate.measure(call)
        comms = [r["comms"] for r in res.ranks]
        p2p = [{op: c.get(op, {}).get("seconds", 0.0) - before[i].get(op, {}).get("seconds", 0.0)
                for op in ("send", "recv")} for i, c in enumerate(comms)]
        out[label] = {"throughput": BATCH * new / wall, "wall": wall, "foreign": foreign,
                      "decode": res.decode_tokens / res.decode_s if res.decode_s else 0.0,
                      "prefill": res.prompt_tokens / res.prefill_s, "p2p": p2p}
        say(f"  {label:10s} {out[label]['throughput']:6.1f} tok/s  (wall {wall:.2f} s, foreign CPU {foreign:.0%})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md as it is")
    opts = ap.parse_args()
    say = lambda msg: print(msg, flush=True)  # noqa: E731
    folder = default_model_dir(progress=False)
    family, args = args_for_config(read_config(folder))
    tok = load_tokenizer(folder)
    text = "The history of the city goes back many centuries, and every street has a story to tell about it."
    base = tok(text * 3)["input_ids"]
    work = [base[i:i + PROMPT_LEN] for i in range(BATCH)]
    pad = pad_id(tok)
    say("measuring point-to-point message cost (gloo ping-pong, 2 ranks)...")
    p2p = measure_p2p(args.dim)
    engines = {}
    for label, (tp, stages, m, threads) in SYSTEMS.items():
        say(f"starting {label}...")
        engines[label] = LocalEngine(*_plan(folder, tp, stages, m), threads=threads).start()
    gate = _decode.QuietGate(budget_s=120.0)
    labels = list(SYSTEMS)
    try:
        for label in labels:  # warm-up: first calls pay one-off costs
            engines[label].generate(work, 4, SamplingParams(), pad, ignore_eos=True)
        rounds = []
        for r in range(opts.rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            say(f"round {r + 1}/{opts.rounds}")
            rounds.append(run_round(engines, order, work, opts.new_tokens, gate, pad, say))
    finally:
        for eng in engines.values():
            eng.stop()
    text = report(rounds, p2p, opts)
    print(text)
    if not opts.no_write:
        _decode.write_section(text, HEADING)


def _med(rounds, label, key):
    return statistics.median(r[label][key] for r in rounds)


def report(rounds: list[dict], p2p: dict, opts) -> str:
    """The RESULTS.md section: setup, results table, message costs and the bubble-model explanation."""
    info = _decode.machine_info()
    base = _med(rounds, "tp 1", "throughput")
    lines = [HEADING, "",
             f"Run {dt.datetime.now().isoformat(timespec='minutes')} with `python bench/pipeline.py "
             f"--rounds {opts.rounds} --new-tokens {opts.new_tokens}`; machine: {info['cpu']}, {info['cores']} cores, "
             f"{info['ram']}, torch {info['torch']}. Bundled SmolLM2-135M-Instruct float32, batch {BATCH} x "
             f"{PROMPT_LEN}-token prompts, {opts.new_tokens} new tokens each, greedy, EOS ignored; pp stages 15/15 "
             f"layers; ranks share the {os.cpu_count()} cores (cores // ranks threads each). Median of "
             f"{opts.rounds} rounds, systems in rotating order.", "",
             "| system | batch tok/s (min-max) | vs tp 1 | decode tok/s | prefill tok/s | send+recv s, rank 0 / rank 1 | "
             "foreign CPU |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label in SYSTEMS:
        thr = _med(rounds, label, "throughput")
        sr = [statistics.median(r[label]["p2p"][i]["send"] + r[label]["p2p"][i]["recv"] for r in rounds)
              for i in range(len(rounds[0][label]["p2p"]))]
        lo, hi = min(r[label]["throughput"] for r in rounds), max(r[label]["throughput"] for r in rounds)
        lines.append(f"| {label} | {thr:.1f} ({lo:.0f}-{hi:.0f}) | {thr / base:.2f}x | {_med(rounds, label, 'decode'):.1f} | "
                     f"{_med(rounds, label, 'prefill'):.0f} | "
                     f"{' / '.join(f'{x:.2f}' for x in sr[:2]) if SYSTEMS[label][1] else '-'} | "
                     f"{max(r[label]['foreign'] for r in rounds):.0%} |")
    lines += ["", "Point-to-point cost (gloo over 127.0.0.1, ping-pong between two ranks, median of 200, one way):", "",
              "| message | bytes | µs |", "|---|---:|---:|"]
    lines += [f"| {k} | {b} | {s * 1e6:.0f} |" for k, (b, s) in p2p.items()]
    lines += ["", *explain(rounds, p2p), ""]
    return "\n".join(lines)


def explain(rounds: list[dict], p2p: dict) -> list[str]:
    """The measured speed-ups of micro-batching next to what the bubble model predicts for them."""
    p = 2
    thr = {label: _med(rounds, label, "throughput") for label in SYSTEMS}
    m1, one = thr["pp 2, m 1"], thr["tp 1, 1 thread"]
    step_m1 = BATCH / _med(rounds, "pp 2, m 1", "decode")  # seconds per decode step of the whole batch
    msg = p2p["header (2 int64)"][1] + p2p["decode hidden, m 1 (8 rows)"][1]
    ratio = lambda m: thr[next(k for k in SYSTEMS if k.startswith(f"pp 2, m {m}"))] / m1  # noqa: E731
    return [
        "How to read it, against the bubble model (p = 2 stages, m micro-batches):", "",
        f"- m = 1: a micro-batch is in one stage at a time, so the stages take turns and each has one core: the "
        f"model predicts tp 1 on one thread less the messages. tp 1 on 1 thread: {one:.1f} tok/s; pp 2, m 1: "
        f"{m1:.1f} tok/s ({m1 / one:.2f}x).",
        f"- Prefill is one pass: a stage idles (p - 1)/(m + p - 1) of it, a bubble of (p - 1)/m relative to the "
        f"useful work ({', '.join(f'm {m}: {(p - 1) / m:.2f}' for m in (1, 2, 4, 8))}).",
        "- Decode returns each sampled token to stage 0 before that micro-batch's next step, so with m < p the "
        "stages idle (p - m)/p of each step and with m >= p each has work all the time: m = 2 removes the "
        "bubble. Its gain is bounded by how a stage's forward cost scales with its rows: 2x m = 1 if it scaled "
        "with rows (compute-bound), 1x if only weight reads mattered (memory-bound decode, where m micro-batches "
        "read each stage's weights m times per step). m > p brings no further overlap and only more weight "
        f"reads and per-forward overhead. Measured: {', '.join(f'm {m}: {ratio(m):.2f}x m 1' for m in (2, 4, 8))}.",
        f"- Against tp 1 on both cores ({thr['tp 1']:.1f} tok/s), pp 2 with m = 2 (what the runtime picks by default) "
        f"reaches {thr['pp 2, m 2 (auto)'] / thr['tp 1']:.2f}x and tp 2 {thr['tp 2'] / thr['tp 1']:.2f}x. All three "
        "use the same two cores and the same memory bandwidth, so on one machine none can be much faster than "
        "the others; pipeline stages pay off when the model does not fit one device or the stages sit on "
        "separate devices. This VM's speed moves from run to run (min-max in the table).",
        f"- Messages: one decode hop of the whole batch (header + hidden) costs {msg * 1e6:.0f} µs by ping-pong, "
        f"against a decode step of {step_m1 * 1e3:.1f} ms at m = 1 ({p} hops plus the token back: "
        f"{(p * msg + p2p['header (2 int64)'][1]) / step_m1:.1%} of the step). The send+recv seconds in the table "
        "are far larger because recv also waits while the other stage computes.",
    ]


if __name__ == "__main__":
    main()
