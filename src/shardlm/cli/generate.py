"""`shardlm generate`: flags or a manifest become a Plan, the Plan runs on local ranks, tokens stream out."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel

from shardlm.checkpoint.integrity import DEFAULT_VERIFY, VERIFY_HELP
from shardlm.cli import options as o
from shardlm.cli.common import err, fail, refuse_conflicts
from shardlm.engine.checks import UserError
from shardlm.engine.engine import RankFailure
from shardlm.engine.requests import TokenEvent
from shardlm.engine.session import GenerateRequest, prepare, run_generate
from shardlm.plan.run import RunFlags
from shardlm.runtime.protocol import SamplingParams
from shardlm.settings import Settings


class StreamView:
    """Shows completions as their text arrives: plain text for one prompt, a live panel per prompt for several."""

    def __init__(self, prompts: list[str]):
        self.prompts, self.texts = prompts, ["" for _ in prompts]
        self.live = None
        self.open = True
        if len(prompts) > 1:
            self.live = Live(self._render(), console=Console(), auto_refresh=False, transient=False)
            self.live.start()

    def _render(self) -> Group:
        return Group(*(Panel(t or "...", title=f"[{i}] {p}", title_align="left") for i, (p, t)
                       in enumerate(zip(self.prompts, self.texts))))

    def push(self, row: int, event: TokenEvent) -> None:
        """Append one event's text to prompt `row`'s completion."""
        self.texts[row] += event.text
        if self.live is None:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        else:
            self.live.update(self._render(), refresh=True)

    def close(self) -> None:
        """Finish the output (idempotent)."""
        if self.live is not None:
            self.live.stop()
            self.live = None
        elif self.open:
            print(flush=True)
        self.open = False


def _warn_oversubscribed(world: int) -> None:
    cores = os.cpu_count() or 1
    if world > cores:
        err.print(f"[yellow]warning:[/] {world} ranks on {cores} cores: ranks will share cores, so each step waits "
                  f"for descheduled peers; expect slower decode than with {cores} rank(s)", highlight=False)


def _manifest(path: str | None, layout: dict[str, object]):
    """The manifest's Plan and path (None without --manifest); layout options beside it are refused."""
    if path is None:
        return None
    from shardlm.manifest import ManifestError, read_manifest

    refuse_conflicts(layout, f"--manifest {path}", "fixes the layout, numerics and offload")
    try:
        return read_manifest(path), path
    except ManifestError as e:
        fail(str(e))


def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts; several form one batch."),
    model: Optional[str] = typer.Option(None, parser=o.ModelPath(), help="Local Hugging Face Llama-family folder (default: bundled SmolLM2-135M-Instruct)."),
    tp: Optional[int] = typer.Option(None, "--tp", parser=o.TP, help="Tensor-parallel degree: any value from 1 to the number of attention heads (default 1)."),
    max_new_tokens: int = typer.Option(64, parser=o.MAX_NEW_TOKENS, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, parser=o.TEMPERATURE, help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, parser=o.TOP_P, help="Nucleus sampling threshold in (0, 1]."),
    top_k: int = typer.Option(0, parser=o.TOP_K, help="Keep the k most likely tokens; 0 keeps all."),
    seed: int = typer.Option(0, parser=o.SEED, help="Sampling seed."),
    dtype: Optional[str] = typer.Option(None, help="float32 (default) or bfloat16."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user turn with the chat template."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate all --max-new-tokens even past end-of-sequence."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    pp: Optional[int] = typer.Option(None, "--pp", parser=o.PP, help="Pipeline stages (default 1); world = tp x pp ranks."),
    layers: Optional[str] = typer.Option(None, "--layers", parser=o.LayerCounts(), help="Decoder layers per stage, e.g. 20,10 (default: even)."),
    micro_batches: Optional[int] = typer.Option(None, "--micro-batches", parser=o.MICRO_BATCHES, help="Micro-batches in flight through the stages (default: one per stage)."),
    manifest: Optional[str] = typer.Option(None, "--manifest", parser=o.ExistingPath("file"), help="Run the plan in this manifest (from `shardlm plan`)."),
    quantization: Optional[str] = typer.Option(None, "--quantization", help="Weight-only quantization of linear layers at load: none, int8 (per channel) or int4 (groups of 32)."),
    memory_budget: Optional[int] = typer.Option(None, "--memory-budget", parser=o.MEMORY_BUDGET, help="Weights + read buffers per rank, e.g. 300MB; layers beyond it stream from disk."),
    offload_dir: Optional[str] = typer.Option(None, "--offload-dir", parser=o.NewPath("folder"), help="Folder for streamed layers (default $SHARDLM_HOME/offload)."),
    no_prefetch: bool = typer.Option(False, "--no-prefetch", help="Read each streamed layer only when it is needed (for comparison)."),
    verify: str = typer.Option(DEFAULT_VERIFY, "--verify", help=VERIFY_HELP),
    device: Optional[str] = typer.Option(None, "--device", help="cpu (default), or cuda: rank r on GPU r mod the GPUs (NCCL when each rank has its own GPU; ranks sharing one use gloo). With --memory-budget, layers beyond it stay in pinned host memory."),
) -> None:
    """Generate text on tp x pp ranks spawned on this machine; streams the completion to stdout."""
    layout = {"--tp": tp, "--pp": pp, "--layers": ",".join(map(str, layers)) if layers else None,
              "--micro-batches": micro_batches, "--dtype": dtype, "--quantization": quantization,
              "--memory-budget": memory_budget and f"{memory_budget // 2**20}MB", "--offload-dir": offload_dir,
              "--no-prefetch": no_prefetch}
    read = _manifest(manifest, layout)
    given = {k.lstrip("-").replace("-", "_") for k, v in {**layout, "--device": device}.items()
             if v is not None and v is not False}
    flags = RunFlags(tp, pp, layers, micro_batches, dtype or "float32",
                     "none" if quantization is None else quantization, device or "cpu", memory_budget, offload_dir,
                     not no_prefetch)
    request = GenerateRequest(prompts, max_new_tokens, SamplingParams(temperature, top_p, top_k, seed), chat,
                              ignore_eos)
    _run(request, model, flags, given, read, as_json, verify)


def _run(request: GenerateRequest, model, flags: RunFlags, given: set[str], manifest, as_json: bool,
         verify: str) -> None:
    status = err.status("starting ranks...")
    view = None
    try:
        job = prepare(request, model, flags, given, manifest, verify)
        _warn_oversubscribed(job.plan.world)
        view = None if as_json else StreamView(request.prompts)

        def on_event(row: int, event: TokenEvent) -> None:
            status.stop()
            if view is not None:
                view.push(row, event)

        status.start()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())  # the ranks log at the driver's level
        _, summary = run_generate(job, on_event=on_event, settings=Settings.from_env(log_level=level))
    except UserError as e:
        fail(str(e), status=status, view=view)
    except RankFailure as e:
        fail(e.summary if e.user_error else str(e), code=2 if e.user_error else 1, status=status, view=view)
    except KeyboardInterrupt:
        fail("interrupted; every rank was stopped", code=130, status=status, view=view)
    if as_json:
        print(json.dumps(summary))
        return
    view.close()
    t = summary["timings"]
    decode = f"{t['decode_tokens_per_s']:.1f}" if t["decode_tokens_per_s"] else "-"
    pp = f" pp={summary['pp']}" if summary["pp"] > 1 else ""
    err.print(f"[dim]tp={summary['tp']}{pp} load {t['load_s']:.1f} s, prefill {t['prefill_tokens_per_s']:.0f} tok/s, "
              f"decode {decode} tok/s, peak RSS per rank "
              + ", ".join(f"{r['peak_rss_bytes'] / 2**20:.0f} MiB" for r in summary["ranks"]) + "[/]")
