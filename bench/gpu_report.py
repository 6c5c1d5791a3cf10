"""Render bench/gpu.py's JSON (a decode run and an offload run, possibly separate) into RESULTS.md."""

from __future__ import annotations

import statistics

from decode import write_section

HEADING = "## GPU: decode and host-RAM offload (bench/gpu.py)"
MiB = 2**20


def _cell(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def _decode_table(run: dict) -> list[str]:
    copy = run["floors"]["copy"]
    out = ["| model | system | decode tok/s, median (min-max) | vs transformers | weights MiB | floor tok/s | "
           "of floor | first tokens equal to transformers |", "|---|---|---|---|---|---|---|---|"]
    by_model: dict[str, list[dict]] = {}
    for row in run["decode"]:
        by_model.setdefault(row["model"], []).append(row)
    for model, rows in by_model.items():
        peer = next((r for r in rows if r["system"] == "transformers" and "error" not in r), None)
        ref = statistics.median(peer["tok_s"]) if peer else float("nan")
        ours = next((r for r in rows if r["system"] == "shardlm"), None)
        for r in rows:
            if "error" in r:
                out.append(f"| {model} | {r['system']} | failed: {r['error'][:200]} | | | | | |")
                continue
            med = statistics.median(r["tok_s"])
            # the transformers row holds the file size; in memory it holds what the unquantized shardlm run does
            weight = ours["weight_bytes"] if r["system"] == "transformers" and ours else r["weight_bytes"]
            floor = r.get("rows", 1) * copy / weight  # a step reads the weights once for all its rows
            out.append(f"| {model} | {r['system']} | {_cell(r['tok_s'])} | {med / ref:.2f}x | "
                       f"{weight / MiB:.0f} | {floor:.0f} | {med / floor:.1%} | "
                       f"{r['tokens_equal_to_transformers']} of {r['tokens']} |")
    return out


def _offload_table(run: dict, decode: dict | None) -> list[str]:
    h2d = run["floors"]["h2d_pinned"]
    out = ["| model, GPU budget | system | decode tok/s, median (min-max) | vs Accelerate | resident on GPU MiB | "
           "streamed MiB/token | PCIe floor tok/s | of floor | copy ready in time | GPU wait ms/token |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for part in run["offload"]:
        acc = part["systems"].get("accelerate", {})
        acc_med = statistics.median(acc["tok_s"]) if "tok_s" in acc else None
        label = (f"{part['model']} {part['dtype']}, {part['budget'] / MiB:.0f} MiB = {part['fraction']:.0%} of "
                 f"{part['weights'] / MiB:.0f} MiB")
        for name, r in part["systems"].items():
            if "tok_s" not in r:
                out.append(f"| {label} | {name} | failed: see the JSON | | | | | | | |")
                continue
            med = statistics.median(r["tok_s"])
            vs = f"{med / acc_med:.1f}x" if acc_med else "-"
            if name == "accelerate":
                placed = ", ".join(f"{k}: {v}" for k, v in r["placed"].items())
                out.append(f"| {label} | Accelerate (modules placed {placed}) | {_cell(r['tok_s'])} | 1.0x | "
                           f"peak {r['peak_gpu_bytes'] / MiB:.0f} | - | - | - | - | - |")
                continue
            floor = h2d / r["per_token"]
            out.append(f"| {label} | {name} | {_cell(r['tok_s'])} | {vs} | {r['resident'] / MiB:.0f} | "
                       f"{r['per_token'] / MiB:.0f} | {floor:.1f} | {med / floor:.1%} | {r['hit_rate']:.1%} | "
                       f"{r['wait_s_per_token'] * 1e3:.1f} |")
        if decode:  # streamed layers decode eagerly (their hooks run between steps): compare with eager
            same = {d["system"]: d for d in decode["decode"] if d["model"] == f"{part['model']} {part['dtype']}"}
            row = same.get("shardlm eager") or same.get("shardlm")
            if row:
                out.append(f"| {label} | ({row['system']}, every weight on the GPU, from the decode run) | "
                           f"{_cell(row['tok_s'])} | | | | | | | |")
    return out


def write_report(runs: list[dict], paths: list[str]) -> None:
    """Write the RESULTS.md section from `runs` (read from `paths`)."""
    decode = next((r for r in runs if r.get("decode")), None)
    offload = next((r for r in reversed(runs) if r.get("offload")), None)
    lines = [HEADING, ""]
    for run, path in zip(runs, paths):
        f = run["floors"]
        lines.append(f"- `{run['command']}` at {run['when']} (UTC) on {run['gpu']}, torch {run['torch']}; "
                     f"{run['rounds']} rounds, {run['new_tokens']} new tokens"
                     f"{' (offload: ' + str(min(run['new_tokens'], 64)) + ')' if run.get('offload') else ''}; {run['seconds']:.0f} s; "
                     f"raw: `{path}`. Floors measured in that run: device copy {f['copy'] / 1e9:.0f} GB/s "
                     f"(read + write), pinned host-to-device {f['h2d_pinned'] / 1e9:.1f} GB/s, pageable "
                     f"{f['h2d_pageable'] / 1e9:.1f} GB/s.")
    lines.append("- Weights are random with the published configs (models/random.py), batch 1, a 40-token prompt, "
                 "greedy, EOS ignored; decode tok/s = (N - 1) / (wall(generate N) - wall(generate 1)), synchronized; "
                 "systems alternate within each round after a full-length warm-up.")
    if decode:
        lines += ["", "Decode, everything on one GPU (floor: weight bytes / device copy bandwidth):", ""]
        lines += _decode_table(decode)
    if offload:
        lines += ["", "Host-RAM offload: layers beyond the GPU budget stream from pinned host memory "
                  "(PCIe floor: bytes streamed per token / pinned host-to-device bandwidth):", ""]
        lines += _offload_table(offload, decode)
        lines.append("")
        for part in offload["offload"]:
            toks = {name: r.get("tokens") for name, r in part["systems"].items()}
            ours, others = toks.get("shardlm prefetch"), [n for n in toks if n != "shardlm prefetch"]
            same = ", ".join(f"{n}: {'same' if toks[n] == ours else 'different'}" for n in others)
            lines.append(f"- {part['model']}: the {len(ours or [])} greedy tokens of shardlm prefetch against {same}.")
    write_section("\n".join(lines) + "\n", HEADING)
