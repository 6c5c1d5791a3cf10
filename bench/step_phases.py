"""Where a batch-1 decode step's time goes, phase by phase, against the read bandwidth of the same moment.

    python bench/step_phases.py [--formats int8,int4,float32,bfloat16] [--rounds 3] [--no-write]

Per format, one process started with a rank's environment (huge pages unless SHARDLM_HUGE_PAGES=0) builds rank 0 of
the bundled model's one-rank plan (int8/int4 with the int8 embedding) and decodes as bench/floor_share.py does (a
40-token prompt, 128 greedy tokens in steps of 8, `sum()` bandwidth right before and after each round), with the
fused step's phase clock on (csrc/team.h): each thread's seconds of work before each of a block's six barriers and of
waiting in them. A phase's rate is the weight bytes it reads a token over its mean work time across threads (the
threads read their shares at once); a phase whose rate stays put while the bandwidth rises is bound by its kernel,
not by memory. "outside" is the step's time outside the blocks' parallel region: embedding, final norm, LM head,
argmax.
"""

from __future__ import annotations

import datetime as dt
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
HEADING = "## Where a batch-1 decode step's time goes, phase by phase (bench/step_phases.py)"
PHASES = ("q/k/v", "rotary", "attention", "o", "gate/up", "down")
WEIGHTS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 3, "gate_proj": 4, "up_proj": 4, "down_proj": 5}


def phase_bytes(module) -> list[int]:
    """Weight bytes each phase reads a token (the blocks' projections, by their names)."""
    out = [0] * len(PHASES)
    for name, m in module.named_modules():
        phase = WEIGHTS.get(name.rsplit(".", 1)[-1])
        if phase is None:
            continue
        kw = getattr(m, "kernel_weight", None)
        out[phase] += kw.nbytes() if kw is not None else sum(p.numel() * p.element_size() for p in m.parameters())
    return out


def child(fmt: str, rounds: int) -> dict:
    """In a process of its own: each round's ms a token, region ms, phase seconds and bandwidth; the phase bytes."""
    sys.path.insert(0, str(BENCH))
    import torch
    from decode_common import measure_bandwidth
    from shardlm.runtime.protocol import SamplingParams
    from shardlm.runtime.work import Decode, Prefill, SlotStart, Step
    from step_vs_commit import one_rank_runner

    runner = one_rank_runner({"float32": "f32", "bfloat16": "bf16"}.get(fmt, fmt), 2)
    ops = runner.rank.ops
    if ops is None or not hasattr(ops, "step_phases"):
        raise SystemExit(f"{fmt}: this rank runs no compiled fused step (kernels: {runner.rank.kernels.describe()})")
    greedy, prompt, out = SamplingParams(), tuple(range(100, 140)), []
    for r in range(rounds + 1):  # round 0 warms up
        runner.run(Step(0, (SlotStart(0, 0),), (Prefill(0, prompt, 0, True, greedy),), ()))
        before = measure_bandwidth(512, 64, 6)["read"]
        ops.step_phases(True)
        t0 = time.perf_counter()
        for i in range(16):
            runner.run(Step(1 + i, (), (), (Decode(0, None if i else 5, len(prompt) + 8 * i, greedy),), 8))
        seconds = time.perf_counter() - t0
        times, region, steps = ops.step_phase_times()
        ops.step_phases(False)
        after = measure_bandwidth(512, 64, 6)["read"]
        threads = [t for t in times.tolist() if any(w + x for w, x in t)]
        if not threads or steps == 0:
            raise SystemExit(f"{fmt}: the phase clock timed no step (it times teams of up to 64 threads; this rank "
                             f"ran {torch.get_num_threads()})")
        if r:
            out.append({"ms": seconds / 128 * 1e3, "region_ms": region / 128 * 1e3, "steps": steps,
                        "threads": threads, "before": before, "after": after})
    return {"rounds": out, "bytes": phase_bytes(runner.rank.module), "resident": runner.rank.resident_bytes()}


def round_cells(r: dict, nbytes: list[int]) -> list[str]:
    """One round's cells: bandwidth, ms a token, outside the region, each phase's work (and rate), the waits."""
    n = len(r["threads"])
    work = [statistics.mean(t[p][0] for t in r["threads"]) / 128 * 1e3 for p in range(len(PHASES))]  # ms a token
    wait = statistics.mean(sum(t[p][1] for p in range(len(PHASES))) for t in r["threads"]) / 128 * 1e3
    cells = [f"{r['before']:.0f}-{r['after']:.0f}", f"{r['ms']:.2f}", f"{r['ms'] - r['region_ms']:.2f}"]
    for p, ms in enumerate(work):
        cells.append(f"{ms:.3f} ({nbytes[p] / ms / 1e6:.0f} GB/s)" if nbytes[p] else f"{ms:.3f}")
    return cells + [f"{wait:.3f} ({n} threads)"]


def main() -> None:
    """Run each format in a child process, print the table, record it unless --no-write."""
    sys.path.insert(0, str(BENCH))
    from decode_common import format_args, format_child, record

    args = format_args(__doc__, "int8,int4,float32,bfloat16", 3, child)
    if args is None:
        return

    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    rows = ["| format | read GB/s before-after | ms a token | outside the blocks | " + " | ".join(PHASES)
            + " | waits, mean of threads |", "|" + "---|" * (5 + len(PHASES))]
    for fmt in args.formats.split(","):
        got = format_child(__file__, fmt, args.rounds)
        for r in got["rounds"]:
            rows.append(f"| {fmt} | " + " | ".join(round_cells(r, got["bytes"])) + " |")
            print(rows[-1], flush=True)
    record(HEADING, f"python bench/step_phases.py --formats {args.formats} --rounds {args.rounds}", started,
           "In-process SlotRunner, batch 1, contexts 40-168, steps of 8 tokens; a row a round; each phase: ms a "
           "token of work, mean over threads (its weights' GB/s).", rows, args.no_write)

if __name__ == "__main__":
    main()
