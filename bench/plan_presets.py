"""What `shardlm plan` picks for five standard setups, beside the layout vLLM's documentation recommends.

    .venv/bin/python bench/plan_presets.py

Calls the planner library (load_model, make_plan), not the CLI, for batch 8 x 8192 tokens, bfloat16,
quantization auto, objectives latency and throughput, and writes bench/RESULTS.md (its "Planner presets" section; paste the printed section there).
Every number is a planner prediction; nothing is run on the hardware named.
"""

from __future__ import annotations

import sys

import datetime
import subprocess
from pathlib import Path

from shardlm.hardware import parse_devices
from shardlm.plan.cost import BANDWIDTH_EFFICIENCY
from shardlm.plan.make import PlanError, load_model, make_plan
from shardlm.plan.plan import IMBALANCE_LIMIT, KVBudget
from shardlm.plan.search import HEADROOM, Request, enumerate_candidates

GiB, BATCH, SEQ = 2**30, 8, 8192
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "RESULTS.md"
HEADING = "## Planner presets vs vLLM's recommended layouts (bench/plan_presets.py)"
SETUPS = [  # model, devices, vLLM's (tp, pp, bf16 weights?), what its docs recommend
    ("llama-3.1-8b", "1xRTX4090-24GB", (1, 1, True), "TP1 bf16; 16 GB weights + 8x8192 bf16 KV do not fit 24 GB, "
     "so vLLM starts with a smaller KV cache (fewer concurrent sequences) or needs a quantized checkpoint"),
    ("llama-3.1-70b", "8xH100-80GB", (8, 1, True), "TP8 (TP = GPUs per node)"),
    ("llama-3.1-70b", "2xRTX4090-24GB,1xA6000-48GB", (1, 3, False), "no TP over 3 unequal GPUs; PP3 with a manual "
     "VLLM_PP_LAYER_PARTITION and a quantized checkpoint (bf16 141 GB > 96 GB total)"),
    ("llama-3.1-405b", "2x8xH100-80GB", (8, 2, True), "TP8 x PP2 (TP = GPUs per node, PP = nodes)"),
    ("mixtral-8x7b", "2xH100-80GB", (2, 1, True), "TP2"),
]


def fullest(plan) -> str:
    r = max(plan.predictions.memory, key=lambda r: r.total / r.capacity)
    return f"{r.total / GiB:.1f} / {r.capacity / GiB:.1f}"


def shape(plan) -> str:
    l, q = plan.layout, plan.quantization.replace("none", "bf16")
    return f"{q} TP{l.tp} PP{l.pp} DP{l.dp} [{'/'.join(str(b - a) for a, b in l.stage_layers)}]"


def cols(plan) -> list[str]:
    """Fullest device GiB, ms per decode step, tok/s alone, tok/s at BATCH (summed over replicas)."""
    p, dp = plan.predictions.performance, plan.layout.dp
    return [fullest(plan), f"{p.decode_latency_s * 1e3:.1f}", f"{p.single_stream_tokens_per_s:.1f}",
            f"{p.decode_tokens_per_s:.1f}" + (f" ({dp}x{BATCH} seqs)" if dp > 1 else "")]


def numbers(plan, memory=True) -> str:
    c, (tok, _, seqs) = cols(plan), cols(plan)[3].partition(" ")
    return (f"{c[0]} GiB, " if memory else "") + f"{c[1]} ms/step, {c[2]} tok/s x1, {tok} tok/s @{BATCH} {seqs}".strip()


def short_reason(c) -> str:
    """Why a candidate was rejected, from its predictions."""
    pred = c.plan.predictions
    if c.overflow > 0:
        w = max(pred.memory, key=lambda r: r.total - r.capacity * HEADROOM)
        return (f"needs {w.total / GiB:.1f} GiB > {HEADROOM:.0%} of {w.capacity / GiB:.1f} GiB on {w.device_name} "
                f"(weights {w.weights / GiB:.1f}, KV {w.kv_cache / GiB:.1f})")
    times = "/".join(f"{t * 1e3:.1f}" for t in pred.performance.stage_times_s)
    return (f"fits ({fullest(c.plan)} GiB) but stage times {times} ms are {pred.performance.imbalance:.0%} out of "
            f"balance (limit {IMBALANCE_LIMIT:.0%})")


def like(cands, tp, pp, quant=None):
    return [c for c in cands if (c.plan.layout.tp, c.plan.layout.pp) == (tp, pp)
            and quant in (None, c.plan.quantization)]


def plan_for(model, devices, objective, quant="auto", batch=BATCH, tp=None):
    """(ranked, all candidates, PlanError text) for one request."""
    ref, family, args = load_model(model)
    req = Request(ref, args, family.tp_plan, parse_devices(devices), devices, "bfloat16", quant, objective,
                  KVBudget(batch, SEQ, min(SEQ, 2048)), tp)
    try:
        res = make_plan(req)
        return res.ranked, res.candidates, ""
    except PlanError as e:
        return [], enumerate_candidates(req), str(e)


def why(best, cands, setup, objective) -> str:
    model, devices, (tp, pp, bf16), _ = setup
    if best is None:
        return "planner refused (PlanError). vLLM's shape here: " + "; ".join(
            f"{shape(c.plan)} {short_reason(c)}" for c in like(cands, tp, pp))
    l, q, out = best.layout, best.quantization, []
    if (l.tp, l.pp, l.dp) == (tp, pp, 1) and (q == "none") == bf16:
        return "same"
    if q != "none":
        bf = min(like(cands, tp, pp, "none"), key=lambda c: c.overflow)
        fits = next((b for b in range(BATCH - 1, 0, -1) if plan_for(model, devices, objective, "none", b, tp)[0]), 0)
        out.append(f"{shape(bf.plan)} {short_reason(bf)}; bf16 fits at most {fits} x {SEQ} tokens, so the planner "
                   f"keeps the asked {BATCH} x {SEQ} KV and picks {q} ({fullest(best)} GiB)")
    if (l.tp, l.pp) != (tp, pp):
        out += [f"vLLM's {shape(c.plan)} predicts {numbers(c.plan) if c.feasible else short_reason(c)}"
                for c in like(cands, tp, pp, q)[:1]]
    if l.dp > 1:
        fair = plan_for(model, devices, objective, q, l.dp * BATCH, tp)[0]
        out.append(f"not a like-for-like win: DP{l.dp} decodes {l.dp}x{BATCH} sequences (batch is per replica); "
                   f"given the same {l.dp * BATCH} sequences, " + (f"{shape(fair[0].plan)} predicts "
                   f"{cols(fair[0].plan)[3]} tok/s" if fair else f"TP{tp} does not fit"))
    return "; ".join(out)


def render(setup, objective) -> tuple[list[str], list[str]]:
    """One setup under one objective: table cells, and the sub-list of alternatives and rejections."""
    model, devices, (tp, pp, _), vllm_words = setup
    ranked, cands, error = plan_for(model, devices, objective)
    best = ranked[0].plan if ranked else None
    rejected = [c for c in cands if not c.feasible]
    lines = [f"{len(cands)} layouts tried: {len(ranked)} ranked, {len(cands) - len(ranked) - len(rejected)} fit "
             f"only at a lossier quantization (auto ranks the least lossy level that fits), {len(rejected)} rejected"]
    lines += [f"  - alternative {i}: {shape(c.plan)}: {numbers(c.plan)}" for i, c in enumerate(ranked[1:4], 2)]
    if error:
        near = sorted((c for c in rejected if c.overflow == 0), key=lambda c: c.plan.predictions.performance.imbalance)
        lines += [f"  - planner message: {error}"] + [
            f"  - fits memory but rejected: {shape(c.plan)}: {short_reason(c)}; it would predict "
            f"{numbers(c.plan, False)}" for c in near[:3]]
    if rejected:
        ex = (like(rejected, tp, pp, "none") or rejected)[0]
        lines.append(f"  - rejected, e.g. {shape(ex.plan)}: {short_reason(ex)}")
    cells = [shape(best), *cols(best)] if best else ["**no plan**", "-", "-", "-", "-"]
    return [*cells, vllm_words, why(best, cands, setup, objective)], lines


def main() -> None:
    rows, details = [], []
    for setup in SETUPS:
        out = {o: render(setup, o) for o in ("latency", "throughput")}
        if out["latency"] == out["throughput"]:  # the same plan either way: one row
            out = {"latency and throughput": out["latency"]}
        for objective, (cells, lines) in out.items():
            rows.append([setup[0], setup[1], objective, *cells])
            details.append(f"- **{setup[0]} on {setup[1]}, {objective}**: " + "\n".join(lines))
    head = ["model", "devices", "objective", "our layout (weights TP PP DP [layers/stage])", "fullest GiB / capacity",
            f"decode ms/step @{BATCH}", "tok/s x1", f"tok/s @{BATCH}", "vLLM docs recommend", "why ours differs"]
    table = "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])
    rev, dirty = (subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT).stdout.strip()
                  for a in (["describe", "--always", "--dirty"], ["status", "--porcelain", "src/shardlm/plan"]))
    rev += " (src/shardlm/plan has uncommitted changes)" if dirty else ""
    text = f"""## Planner presets vs vLLM's recommended layouts (bench/plan_presets.py)

Command: `.venv/bin/python bench/plan_presets.py`. Date: {datetime.date.today()}, commit {rev}.
Every request: batch {BATCH} x {SEQ} tokens, bfloat16, quantization auto, prefill chunk 2048, objective latency and
throughput (one row where both pick the same plan).

**These are predictions, not measurements.** None of this hardware was used: the numbers come from the planner's
memory and speed model (decode reads weights and KV at {BANDWIDTH_EFFICIENCY["cuda"]:.0%} of datasheet bandwidth,
int8/int4 with no dequantization cost; eager mode; the KV cache is half full on average). "fullest" is the device
with the highest predicted use; a plan may fill {HEADROOM:.0%} of it. tok/s @{BATCH} is summed over data-parallel
replicas, and each replica decodes its own batch of {BATCH}.

vLLM column: vLLM's rule is TP = GPUs per node and PP = number of nodes; TP must divide the attention heads and be the
same on every GPU; uneven or non-NVLink GPUs get PP, uneven splits via VLLM_PP_LAYER_PARTITION; there is no automatic
planner, and weights must fit (a quantized checkpoint is a separate model). Source: vLLM docs
`docs/serving/parallelism_scaling.md` and issue #6824, as summarised in /work/shared/research/inference-anchors.md (b).

{table}

Alternatives the planner ranked next, and what it rejected:

{chr(10).join(details)}
"""
    sys.path.insert(0, str(ROOT / "bench"))
    import decode  # its write_section replaces one "## " section of RESULTS.md in place
    decode.write_section(text, HEADING)
    print(text, end="")


if __name__ == "__main__":
    main()
