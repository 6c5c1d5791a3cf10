"""`shardlm generate`: flags or a manifest become a Plan, the Plan runs on local ranks, tokens stream out."""

from __future__ import annotations

import json
import logging
import os
import sys

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel

from shardlm.checkpoint.integrity import DEFAULT_VERIFY
from shardlm.cli import layout as L
from shardlm.cli import options as o
from shardlm.cli.common import err, fail
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


def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts; several form one batch."),
    model: L.Model = None,
    tp: L.Tp = None,
    max_new_tokens: int = typer.Option(64, parser=o.MAX_NEW_TOKENS, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, parser=o.TEMPERATURE, help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, parser=o.TOP_P, help="Nucleus sampling threshold in (0, 1]."),
    top_k: int = typer.Option(0, parser=o.TOP_K, help="Keep the k most likely tokens; 0 keeps all."),
    seed: int = typer.Option(0, parser=o.SEED, help="Sampling seed."),
    dtype: L.Dtype = None,
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user turn with the chat template."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate all --max-new-tokens even past end-of-sequence."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    pp: L.Pp = None,
    layers: L.Layers = None,
    micro_batches: L.MicroBatches = None,
    manifest: L.Manifest = None,
    quantization: L.Quantization = None,
    quantize_embedding: L.QuantizeEmbedding = False,
    memory_budget: L.MemoryBudget = None,
    offload_dir: L.OffloadDir = None,
    no_prefetch: L.NoPrefetch = False,
    verify: L.Verify = DEFAULT_VERIFY,
    device: L.Device = None,
) -> None:
    """Generate text on tp x pp ranks spawned on this machine; streams the completion to stdout."""
    lay = L.layout_of(tp, pp, layers, micro_batches, dtype, quantization, memory_budget, offload_dir, no_prefetch,
                      device, manifest, verify, quantize_embedding)
    request = GenerateRequest(prompts, max_new_tokens, SamplingParams(temperature, top_p, top_k, seed), chat,
                              ignore_eos)
    _run(request, model, lay.flags, lay.given, lay.manifest, as_json, lay.verify)


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
