"""`shardlm inspect`, `plan`, `validate` and `calibrate`: the planner's commands."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from shardlm.cli import options as o
from shardlm.cli.common import err, out
from shardlm.cli.common import fail as _fail
from shardlm.hardware import HardwareError
from shardlm.models.args import ModelConfigError
from shardlm.plan.inspect import inspect_model
from shardlm.plan.layout import LayoutError
from shardlm.plan.make import (PlanError, check_options, cluster_for, default_kv, load_devices, load_model, make_plan,
                               repredict)
from shardlm.plan.plan import Plan
from shardlm.plan.search import Request
from shardlm.plan.validate import violations

GiB = 2**30
USER_ERRORS = (ModelConfigError, HardwareError, PlanError, LayoutError)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def inspect(model: str = typer.Argument(..., help="Preset name (e.g. llama-3.1-8b) or a local model folder."),
            as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Architecture, parameters, bytes per dtype, per-layer sizes and KV bytes per token (no weights needed)."""
    try:
        ref, family, args = load_model(model)
    except USER_ERRORS as e:
        _fail(str(e))
    info = inspect_model(ref.name, family, args)
    if as_json:
        print(json.dumps(info, indent=2))
        return
    s = info["shape"]
    out.print(f"[bold]{ref.name}[/] {info['architecture']} ({info['family']}"
              f"{'' if info['runnable'] else ', planned only: the runtime does not run it yet'})")
    out.print(f"{info['parameters'] / 1e9:.3f} B parameters; {s['layers']} layers, hidden {s['hidden']}, "
              f"{s['heads']} heads / {s['kv_heads']} KV heads x {s['head_dim']}, MLP {s['intermediate']}, vocab "
              f"{s['vocab']}" + (f", {s['experts']} experts ({s['experts_per_token']} per token)" if s["experts"] else "")
              + (", tied embeddings" if s["tied_embeddings"] else ""))
    t = Table(title="Bytes (GiB)")
    t.add_column("unit")
    for f in info["bytes"]:
        t.add_column(f, justify="right")
    for unit in next(iter(info["units"].values())):
        t.add_row(unit, *(_gib(info["units"][f][unit]) for f in info["bytes"]))
    t.add_row("[bold]whole model", *(f"[bold]{_gib(b)}" for b in info["bytes"].values()))
    out.print(t)
    parts = ", ".join(f"{p} {_gib(b)}" for p, b in info["layer_parts_bfloat16"].items())
    out.print(f"one decoder layer in bfloat16: {parts} GiB")
    out.print(f"largest unit: {info['largest_unit']['name']} ({_gib(info['largest_unit']['bytes_bfloat16'])} GiB in "
              f"bfloat16); KV cache per token: {info['kv_cache_bytes_per_token']['bfloat16'] / 1024:.1f} KiB in "
              f"bfloat16, {info['kv_cache_bytes_per_token']['float32'] / 1024:.1f} KiB in float32")


def plan_json(plan: Plan) -> dict:
    """A plan as JSON: layout, per-rank memory, performance, assumptions."""
    pred, lay = plan.predictions, plan.layout
    p = pred.performance
    return {
        "model": plan.model.name, "cluster": plan.cluster, "dtype": plan.dtype, "quantization": plan.quantization,
        "embedding": plan.embedding,
        "parallelism": {"tensor": lay.tp, "pipeline": lay.pp, "data": lay.dp},
        "stages": [{"layers": list(r), "devices": [list(lay.devices[d][s]) for d in range(lay.dp)]}
                   for s, r in enumerate(lay.stage_layers)],
        "offload": {"tier": plan.offload.tier, "layers": list(plan.offload.layers)},
        "kv_cache": {"max_batch": plan.kv.max_batch, "max_seq_len": plan.kv.max_seq_len},
        "ranks": [{"rank": r.rank, "device": r.device, "device_name": r.device_name,
                   "memory": {"weights": r.weights, "kv_cache": r.kv_cache, "activations": r.activations,
                              "overhead": r.overhead, "total": r.total, "offloaded": r.offloaded},
                   "capacity": r.capacity} for r in pred.memory],
        "performance": {"prefill_tokens_per_s": p.prefill_tokens_per_s, "decode_latency_s": p.decode_latency_s,
                        "decode_tokens_per_s": p.decode_tokens_per_s,
                        "single_stream_tokens_per_s": p.single_stream_tokens_per_s,
                        "stage_times_s": list(p.stage_times_s), "bubble": p.bubble, "imbalance": p.imbalance,
                        "micro_batches": p.micro_batches, "breakdown": p.breakdown},
        "assumptions": list(pred.assumptions),
        "violations": violations(plan),
    }


def _candidates_table(ranked, shown: int) -> Table:
    t = Table(title=f"Best {min(shown, len(ranked))} of {len(ranked)} feasible layouts")
    for c in ("#", "quant", "tp", "pp", "dp", "layers", "offload", "fullest GiB", "ms/step",
              "tok/s x1", "tok/s xB", "prefill/s"):
        t.add_column(c, justify="right" if c not in ("quant", "layers", "offload") else "left")
    for i, c in enumerate(ranked[:shown]):
        pl, p = c.plan, c.plan.predictions.performance
        worst = max(pl.predictions.memory, key=lambda r: r.total / r.capacity)
        off = f"{pl.offload.tier} {sum(pl.offload.layers)}" if pl.offload.tier != "none" else "-"
        t.add_row(str(i + 1), pl.quantization, str(pl.layout.tp), str(pl.layout.pp), str(pl.layout.dp),
                  "/".join(str(b - a) for a, b in pl.layout.stage_layers), off,
                  f"{_gib(worst.total)} / {_gib(worst.capacity)}", f"{p.decode_latency_s * 1e3:.1f}",
                  f"{p.single_stream_tokens_per_s:.1f}", f"{p.decode_tokens_per_s:.1f}", f"{p.prefill_tokens_per_s:.0f}")
    return t


def memory_table(plan: Plan, limit: int = 16) -> Table:
    """Per-rank predicted memory of one plan."""
    t = Table(title="Memory per rank (GiB, predicted)")
    for c in ("rank", "device", "weights", "KV", "activ.", "overhead", "total", "capacity", "use"):
        t.add_column(c, justify="left" if c == "device" else "right")
    for r in plan.predictions.memory[:limit]:
        t.add_row(str(r.rank), f"{r.device} {r.device_name}", _gib(r.weights), _gib(r.kv_cache), _gib(r.activations),
                  _gib(r.overhead), _gib(r.total), _gib(r.capacity), f"{r.total / r.capacity:.0%}")
    if len(plan.predictions.memory) > limit:
        t.add_row("...", f"{len(plan.predictions.memory) - limit} more ranks", "", "", "", "", "", "", "")
    return t


def plan(model: str = typer.Argument(..., help="Preset name or local model folder."),
         devices: Optional[str] = typer.Option(None, "--devices", help="e.g. 8xH100-80GB, 2x8xH100-80GB, 2xcpu-4GB"),
         cluster: Optional[str] = typer.Option(None, "--cluster", parser=o.ExistingPath("file"), help="Cluster YAML file."),
         max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", parser=o.MAX_SEQ_LEN, help="Prompt + generated tokens (default min(model, 4096))."),
         max_batch: int = typer.Option(1, "--max-batch", parser=o.MAX_BATCH, help="Sequences decoded together."),
         dtype: str = typer.Option("bfloat16", "--dtype", help="float32 | bfloat16 | float16"),
         quantization: str = typer.Option("auto", "--quantization", help="auto | none | int8 | int4"),
         quantize_embedding: bool = typer.Option(False, "--quantize-embedding", help="Hold the token embedding, and an LM head tied to it, as int8 rows."),
         objective: str = typer.Option("latency", "--objective", help="latency | throughput"),
         tp: Optional[int] = typer.Option(None, "--tp", parser=o.TP, help="Pin the tensor-parallel degree."),
         pp: Optional[int] = typer.Option(None, "--pp", parser=o.PP, help="Pin the number of pipeline stages."),
         layers: Optional[str] = typer.Option(None, "--layers", parser=o.LayerCounts(), help="Pin layers per stage, e.g. 20,10."),
         output: Optional[str] = typer.Option(None, "-o", "--output", parser=o.NewPath("file"), help="Write the best plan as a manifest."),
         figure: Optional[str] = typer.Option(None, "--figure", parser=o.NewPath("file"), help="Draw the best plan (png/svg/pdf)."),
         offload: bool = typer.Option(False, "--offload", help="Allow streaming layers from host RAM or disk."),
         show: int = typer.Option(5, "--show", parser=o.SHOW, help="How many layouts to list."),
         as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Choose tp, pp, stages, quantization and offload for MODEL on the devices; predict memory and speed."""
    try:
        ref, family, args = load_model(model)
        check_options(dtype, quantization, objective, max_batch, 2 if max_seq_len is None else max_seq_len, args)
        clus, cname = load_devices(devices, cluster)
        req = Request(ref, args, family.tp_plan, clus, cname, dtype, quantization, objective,
                      default_kv(max_batch, max_seq_len, args), tp, pp, layers, offload,
                      embedding="int8" if quantize_embedding else "float")
        if req.layers is not None and req.pp is None:
            req = replace(req, pp=len(req.layers))
        result = make_plan(req)
    except USER_ERRORS as e:
        _fail(str(e))
    best = result.ranked[0].plan
    _write_outputs(best, output, figure)
    if as_json:
        rejected = [{"quantization": c.plan.quantization, "tp": c.plan.layout.tp, "pp": c.plan.layout.pp,
                     "dp": c.plan.layout.dp, "reason": c.reason} for c in result.candidates if not c.feasible]
        print(json.dumps({"best": plan_json(best), "ranked": [plan_json(c.plan) for c in result.ranked[:show]],
                          "rejected": rejected}, indent=2))
        return
    _print_plan(result, best, show)
    if output:
        out.print(f"manifest written to [bold]{output}[/]; check it with `shardlm validate {output}`")
    if figure:
        out.print(f"figure written to [bold]{figure}[/]")


def _write_outputs(best: Plan, output: Optional[str], figure: Optional[str]) -> None:
    if output:
        from shardlm.manifest import write_manifest
        try:
            write_manifest(best, output)
        except OSError as e:  # atomic: nothing was written; the error names the path
            _fail(f"{e.strerror}: {e.filename}; nothing was written: choose a writable path for -o")
    if figure:
        from shardlm.plan.figure import draw_plan
        try:
            draw_plan(best, figure)
        except ValueError as e:
            _fail(str(e))


def _print_plan(result, best: Plan, show: int) -> None:
    req = result.request
    out.print(f"[bold]{req.model.name}[/] on {req.cluster.describe()}: {req.dtype}, quantization {req.quantization}"
              f"{', int8 embedding' if req.embedding == 'int8' else ''}, "
              f"objective {req.objective}, batch {req.kv.max_batch} x {req.kv.max_seq_len} tokens")
    out.print(_candidates_table(result.ranked, show))
    rejected = [c for c in result.candidates if not c.feasible]
    if rejected:
        out.print(f"{len(rejected)} layouts rejected, e.g.:")
        for c in rejected[:3]:
            l = c.plan.layout
            out.print(f"  {c.plan.quantization} tp={l.tp} pp={l.pp} dp={l.dp}: {c.reason}", highlight=False)
    out.print(memory_table(best))
    for v in violations(best):
        out.print(f"[yellow]warning:[/] {v}", highlight=False)
    out.print("assumptions: " + "; ".join(best.predictions.assumptions), highlight=False)


def validate(manifest: str = typer.Argument(..., parser=o.ExistingPath("file"), help="Manifest YAML written by `shardlm plan` (maybe edited)."),
             as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Re-predict a manifest and check every device's budget and the stage balance; exit 2 on a violation."""
    from shardlm.manifest import ManifestError, check_devices, check_model, read_manifest
    try:
        read = read_manifest(manifest)
        check_model(read, load_model(read.model.name)[0], manifest)
        check_devices(read, cluster_for(read.cluster), manifest)
        plan_ = repredict(read)
    except (ManifestError, *USER_ERRORS) as e:
        _fail(str(e))
    problems = violations(plan_)
    if as_json:
        print(json.dumps({**plan_json(plan_), "ok": not problems}, indent=2))
    else:
        out.print(memory_table(plan_))
        p = plan_.predictions.performance
        out.print(f"predicted: decode {p.decode_latency_s * 1e3:.1f} ms/step, {p.decode_tokens_per_s:.1f} tok/s "
                  f"(batch {plan_.kv.max_batch}), {p.single_stream_tokens_per_s:.1f} tok/s for one sequence; "
                  f"stage imbalance {p.imbalance:.0%}")
    if problems:
        for v in problems:
            err.print(f"[bold red]error:[/] {escape(v)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    if not as_json:
        out.print(f"[green]ok:[/] {manifest} fits its devices and its stages are balanced")


def calibrate() -> None:
    """Measure this machine (decode bandwidth, FLOP/s, per-layer overhead, rank memory) for CPU plans."""
    from rich.progress import Progress

    from shardlm.calibrate import calibrate as run, write_calibration
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("calibrating", total=4)

        def step(name: str) -> None:
            bar.update(task, advance=1, description=f"measuring {name}")
        data = run(step)
    path = write_calibration(data)
    c = data["cpu"]
    out.print(f"{c['cores']} cores: decode bandwidth {c['bandwidth'] / 1e9:.1f} GB/s, {c['flops'] / 1e9:.0f} GFLOP/s, "
              f"{c['layer_overhead_s'] * 1e6:.0f} us per layer per step, rank runtime "
              f"{c['runtime_bytes'] / 2**20:.0f} MiB; written to {path}")
