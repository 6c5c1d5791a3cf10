"""Planner honesty: predicted vs measured peak memory per rank and decode tokens/s on this machine.

    .venv/bin/python bench/plan_honesty.py [--calibrate] [--no-write]
`--calibrate` measures this machine first, in the same run (what `shardlm calibrate` does, and
written where it writes), and re-measures the decode bandwidth before each round: this VM's memory
bandwidth moves by up to 2x from minute to minute (33 <-> 60 GB/s seen), so a calibration from
another moment compares two different machines. Without it the saved calibration is used.
Every layout is measured `--rounds` times (default 3), interleaved; the table gives medians.
It runs the bundled SmolLM2-135M and a random-weight 600 MB Llama at tp 1..4 (float32, batch 1,
64-token prompt, 64 new tokens), predicts each with the planner for the same layout, and writes
the "Planner honesty" section of bench/RESULTS.md. Targets: memory within 10 %, decode within 25 %.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as _decode  # noqa: E402
from shardlm import bundled, hardware  # noqa: E402
from shardlm.models.args import read_config  # noqa: E402
from shardlm.models.presets import PRESETS  # noqa: E402
from shardlm.models.random import write_random_checkpoint  # noqa: E402
from shardlm.models.registry import args_for_config  # noqa: E402
from shardlm.plan.layout import ParallelLayout  # noqa: E402
from shardlm.plan.plan import KVBudget  # noqa: E402
from shardlm.plan.predict import Setting, predict  # noqa: E402
from shardlm.engine import LocalEngine  # noqa: E402
from shardlm.engine.session import plan_run  # noqa: E402
from shardlm.plan.run import RunFlags  # noqa: E402
from shardlm.runtime.protocol import SamplingParams  # noqa: E402

HEADING = "## Planner honesty: predicted vs measured (bench/plan_honesty.py)"
PROMPT, NEW = 64, 64
WIDE = {**PRESETS["debug"], "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}


def predicted(folder: Path, tp: int):
    fam, args = args_for_config(read_config(folder))
    cal = hardware.read_calibration()
    cluster = hardware.parse_devices(f"{tp}xcpu-{max(1, int(20 / tp))}GB")
    layout = ParallelLayout(tp, 1, 1, ((0, args.n_layers),), ((tuple(f"0:{i}" for i in range(tp)),),))
    st = Setting(args, fam.tp_plan, cluster, "float32", "none", KVBudget(1, PROMPT + NEW, PROMPT))
    return predict(st, layout), cal is not None


def measured(folder: Path, tp: int):
    prompt = [[(7 * i) % 1000 + 3 for i in range(PROMPT)]]
    with LocalEngine(*plan_run(str(folder), RunFlags(tp=tp), KVBudget(1, PROMPT + NEW, PROMPT))) as engine:
        result = engine.generate(prompt, NEW, SamplingParams(), ignore_eos=True)
    return [r["peak_rss_bytes"] for r in result.ranks], result.decode_tokens / result.decode_s


def run(models: dict[str, Path], tps: list[int], rounds: int, rebandwidth: bool) -> list[dict]:
    """Every (model, tp) once per round, in the same order; with `rebandwidth` each round first
    re-measures the decode bandwidth into the calibration (the rest of it is kept)."""
    rows = []
    for r in range(rounds):
        if rebandwidth:
            _remeasure_bandwidth()
        for name, folder in models.items():
            for tp in tps:
                pred, calibrated = predicted(folder, tp)
                rss, tps_meas = measured(folder, tp)
                for m, peak in zip(pred.memory, rss):
                    rows.append({"round": r, "model": name, "tp": tp, "rank": m.rank, "pred_mem": m.total,
                                 "meas_mem": peak, "pred_tps": pred.performance.single_stream_tokens_per_s,
                                 "meas_tps": tps_meas, "calibrated": calibrated,
                                 "bandwidth": hardware.read_calibration()["cpu"]["bandwidth"] if calibrated else None})
                print(f"round {r + 1}/{rounds} {name} tp{tp}: memory {[round(m.total / 2**20) for m in pred.memory]} vs "
                      f"{[round(x / 2**20) for x in rss]} MiB; decode {rows[-1]['pred_tps']:.1f} vs {tps_meas:.1f} tok/s",
                      flush=True)
    return rows


def _remeasure_bandwidth() -> None:
    from shardlm.calibrate import decode_bandwidth, write_calibration

    cal = hardware.read_calibration()
    cal["cpu"]["bandwidth"] = decode_bandwidth()
    write_calibration(cal)
    print(f"  decode bandwidth now {cal['cpu']['bandwidth'] / 1e9:.1f} GB/s", flush=True)


def merged(rows: list[dict]) -> list[dict]:
    """One row per (model, tp, rank): medians over rounds, with each round's decode pair kept."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["tp"], row["rank"]), []).append(row)
    out = []
    for rs in groups.values():
        med = lambda key: statistics.median(x[key] for x in rs)  # noqa: E731
        out.append({**rs[0], "pred_mem": med("pred_mem"), "meas_mem": med("meas_mem"), "pred_tps": med("pred_tps"),
                    "meas_tps": med("meas_tps"), "round_errors": [x["pred_tps"] / x["meas_tps"] - 1 for x in rs],
                    "bandwidths": [x["bandwidth"] for x in rs]})
    return out


def section(rows: list[dict], cmd: str, rounds: int) -> str:
    cal = hardware.read_calibration()
    mem_err = [abs(r["pred_mem"] / r["meas_mem"] - 1) for r in rows]
    tps_err = [abs(r["pred_tps"] / r["meas_tps"] - 1) for r in rows if r["rank"] == 0]
    bws = sorted({b for r in rows for b in r["bandwidths"] if b})
    out = [HEADING, "",
           f"Command: `{cmd}` on {datetime.date.today()}, {platform.machine()} with {os.cpu_count()} cores. "
           f"Calibration: {cal['date'] + ' ' + str({k: round(v, 6) for k, v in cal['cpu'].items()}) if cal else 'none (defaults)'}.",
           f"Float32, batch 1, {PROMPT}-token prompt, {NEW} new tokens, {rounds} rounds (every layout once per round, "
           "same order); the table gives medians over rounds. Memory: planner total per rank vs the rank's peak RSS "
           "(VmHWM). Decode: planner single-stream tok/s vs measured."
           + (f" Each round first re-measured the decode bandwidth the planner predicts from (this VM's memory "
              f"bandwidth moves by up to 2x from minute to minute): {', '.join(f'{b / 1e9:.1f}' for b in bws)} GB/s."
              if bws and len(rows) and len(rows[0]["bandwidths"]) > 1 else ""), "",
           "| model | tp | rank | predicted MiB | measured MiB | error | predicted tok/s | measured tok/s | error | "
           "error per round |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        first = r["rank"] == 0
        out.append(f"| {r['model']} | {r['tp']} | {r['rank']} | {r['pred_mem'] / 2**20:.0f} | {r['meas_mem'] / 2**20:.0f} "
                   f"| {r['pred_mem'] / r['meas_mem'] - 1:+.1%} | "
                   + (f"{r['pred_tps']:.1f} | {r['meas_tps']:.1f} | {r['pred_tps'] / r['meas_tps'] - 1:+.1%} | "
                      + ", ".join(f"{e:+.0%}" for e in r["round_errors"]) + " |" if first else " | | | |"))
    cores = os.cpu_count() or 1
    fit = [abs(r["pred_tps"] / r["meas_tps"] - 1) for r in rows if r["rank"] == 0 and r["tp"] <= cores]
    out += ["", f"Largest memory error {max(mem_err):.1%} (target 10 %: {'met' if max(mem_err) <= 0.10 else 'NOT met'}); "
            f"largest decode error {max(tps_err):.1%} (target 25 %: {'met' if max(tps_err) <= 0.25 else 'NOT met'}); "
            f"with no more ranks than the {cores} cores, {max(fit):.1%}." if fit else ""]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md as it is")
    ap.add_argument("--tp", default="1,2,3,4", help="tp degrees to run")
    ap.add_argument("--calibrate", action="store_true", help="measure this machine first, in this run, and "
                    "re-measure its decode bandwidth before every round")
    ap.add_argument("--rounds", type=int, default=3, help="times every layout is measured (medians reported)")
    a = ap.parse_args()
    if a.calibrate:
        from shardlm.calibrate import calibrate, write_calibration

        print(f"calibrated: {write_calibration(calibrate(lambda name: print('  measuring', name, flush=True)))}")
    with tempfile.TemporaryDirectory() as tmp:
        wide = write_random_checkpoint(WIDE, Path(tmp) / "wide")
        models = {"SmolLM2-135M (bundled)": bundled.resolve_model(None), "random Llama 155M (wide)": wide}
        rows = merged(run(models, [int(x) for x in a.tp.split(",")], a.rounds, a.calibrate))
    text = section(rows, "python bench/plan_honesty.py" + (" --calibrate" if a.calibrate else ""), a.rounds)
    print(text)
    if not a.no_write:
        _decode.write_section(text, HEADING)


if __name__ == "__main__":
    main()
