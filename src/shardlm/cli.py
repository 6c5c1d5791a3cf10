"""The `shardlm` command line: parse, call the library, print with rich."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel

from shardlm.checkpoint.integrity import DEFAULT_VERIFY, VERIFY_HELP
from shardlm.runtime.engine import RankFailure
from shardlm.runtime.messages import SamplingParams
from shardlm.runtime.session import GenerateOptions, UserError, prepare, run_generate
from shardlm.runtime.text import StreamDecoder

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run language models sharded across processes and devices.")
err = Console(stderr=True)


def _fail(message: str, code: int = 2, status=None, view=None) -> None:
    if status is not None:
        status.stop()
    if view is not None:
        view.close()
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _warn_oversubscribed(world: int, heads: int) -> None:
    cores = os.cpu_count() or 1
    if world > cores:
        err.print(f"[yellow]warning:[/] {world} ranks on {cores} cores: ranks will share cores, so each step waits "
                  f"for descheduled peers; expect slower decode than with {cores} rank(s)", highlight=False)


class StreamView:
    """Shows completions as tokens arrive: plain text for one prompt, a live panel per prompt for several."""

    def __init__(self, tokenizer, prompts: list[str]):
        self.decoders = [StreamDecoder(tokenizer) for _ in prompts]
        self.prompts, self.texts = prompts, ["" for _ in prompts]
        self.live = None
        if len(prompts) > 1:
            self.live = Live(self._render(), console=Console(), auto_refresh=False, transient=False)
            self.live.start()

    def _render(self) -> Group:
        return Group(*(Panel(t or "...", title=f"[{i}] {p}", title_align="left") for i, (p, t)
                       in enumerate(zip(self.prompts, self.texts))))

    def push(self, tokens: list[int]) -> None:
        """Append one step's tokens (-1 marks a finished row)."""
        for i, tok in enumerate(tokens):
            if tok >= 0:
                new = self.decoders[i].push(tok)
                self.texts[i] += new
                if self.live is None:
                    sys.stdout.write(new)
                    sys.stdout.flush()
        if self.live is not None:
            self.live.update(self._render(), refresh=True)

    def close(self) -> None:
        """Finish the output (idempotent)."""
        if self.live is not None:
            self.live.stop()
            self.live = None
        elif self.decoders is not None:
            print(flush=True)
        self.decoders = None


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details.")) -> None:
    """shardlm: plan, shard and run language models across devices."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s")


@app.command()
def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts; several form one batch."),
    model: Optional[str] = typer.Option(None, help="Local Hugging Face Llama-family folder (default: bundled SmolLM2-135M-Instruct)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel degree: any value from 1 to the number of attention heads (default 1)."),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling threshold in (0, 1]."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens; 0 keeps all."),
    seed: int = typer.Option(0, help="Sampling seed."),
    dtype: str = typer.Option("float32", help="float32 or bfloat16."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user turn with the chat template."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate all --max-new-tokens even past end-of-sequence."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    pp: Optional[int] = typer.Option(None, "--pp", help="Pipeline stages (default 1); world = tp x pp ranks."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Decoder layers per stage, e.g. 20,10 (default: even)."),
    micro_batches: Optional[int] = typer.Option(None, "--micro-batches", help="Micro-batches in flight through the stages (default: one per stage)."),
    manifest: Optional[str] = typer.Option(None, "--manifest", help="Run the plan in this manifest (from `shardlm plan`)."),
    quantization: Optional[str] = typer.Option(None, "--quantization", help="Weight-only quantization of linear layers at load: none, int8 (per channel) or int4 (groups of 32)."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", help="Weights + read buffers per rank, e.g. 300MB; layers beyond it stream from disk."),
    offload_dir: Optional[str] = typer.Option(None, "--offload-dir", help="Folder for streamed layers (default $SHARDLM_HOME/offload)."),
    no_prefetch: bool = typer.Option(False, "--no-prefetch", help="Read each streamed layer only when it is needed (for comparison)."),
    device: str = typer.Option("cpu", "--device", help="cpu, or cuda: rank r on GPU r mod the GPUs (NCCL when each rank has its own GPU; ranks sharing one use gloo). With --memory-budget, layers beyond it stay in pinned host memory."),
    verify: str = typer.Option(DEFAULT_VERIFY, "--verify", help=VERIFY_HELP),
) -> None:
    """Generate text on tp x pp ranks spawned on this machine; streams the completion to stdout."""
    given = {"tp": tp is not None, "pp": pp is not None, "layers": layers is not None,
             "quantization": quantization is not None}
    opts = GenerateOptions(prompts=prompts, model=model, tp=tp or 1, max_new_tokens=max_new_tokens,
                           sampling=SamplingParams(temperature, top_p, top_k, seed), dtype=dtype, chat=chat,
                           ignore_eos=ignore_eos, pp=pp or 1, layers=layer_counts(layers), micro_batches=micro_batches,
                           quantization=None if quantization in (None, "none") else quantization,
                           memory_budget=size_flag("--memory-budget", memory_budget), offload_dir=offload_dir, prefetch=not no_prefetch,
                           device=device, verify=verify)
    if manifest:
        opts = _from_manifest(manifest, opts, given)
    tp, world = opts.tp, opts.world
    status = err.status(f"starting {world} rank{'s' if world > 1 else ''}...")
    view = None
    try:
        job = prepare(opts)
        _warn_oversubscribed(world, job.args.n_heads)
        view = None if as_json else StreamView(job.tokenizer, prompts)

        def on_token(tokens: list[int]) -> None:
            status.stop()
            if view is not None:
                view.push(tokens)

        status.start()
        result, summary = run_generate(job, on_token=on_token)
    except UserError as e:
        _fail(str(e), status=status, view=view)
    except RankFailure as e:
        _fail(e.summary if e.user_error else str(e), code=2 if e.user_error else 1, status=status, view=view)
    except KeyboardInterrupt:
        _fail("interrupted; every rank was stopped", code=130, status=status, view=view)
    if as_json:
        print(json.dumps(summary))
        return
    view.close()
    t = summary["timings"]
    decode = f"{t['decode_tokens_per_s']:.1f}" if t["decode_tokens_per_s"] else "-"
    err.print(f"[dim]tp={tp}{f' pp={opts.pp}' if opts.pp > 1 else ''} load {t['load_s']:.1f} s, prefill {t['prefill_tokens_per_s']:.0f} tok/s, "
              f"decode {decode} tok/s, peak RSS per rank "
              + ", ".join(f"{r['peak_rss_bytes'] / 2**20:.0f} MiB" for r in summary["ranks"]) + "[/]")


def size_flag(flag: str, text: str | None) -> int | None:
    """Parse a size flag such as --memory-budget or --max-shard-size (300MB, 1.5GB; GB means GiB);
    exits with a one-line error for anything unparsable or below 1MB."""
    if text is None:
        return None
    from shardlm.hardware import HardwareError, parse_size

    try:
        n = parse_size(text)
    except HardwareError as e:
        _fail(f"{flag}: {e}")
    if n < 2**20:
        _fail(f"{flag} {text} is below 1MB; give a size such as 500MB or 2GB")
    return n


def layer_counts(text: str | None) -> tuple[int, ...] | None:
    """Parse --layers "20,10" into (20, 10); exits with a one-line error for anything else."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        _fail(f"--layers {text!r} is not a comma-separated list of layer counts, e.g. --layers 20,10")


def _from_manifest(path: str, opts: GenerateOptions, given: dict[str, bool]) -> GenerateOptions:
    from shardlm.manifest import ManifestError, read_manifest
    from shardlm.runtime.from_manifest import apply_manifest

    try:
        return apply_manifest(read_manifest(path), path, opts, given)
    except (ManifestError, UserError) as e:
        _fail(str(e))


from shardlm import cli_ckpt, cli_eval, cli_plan  # noqa: E402,F401  (register the planner, checkpoint and eval commands)

if __name__ == "__main__":
    from shardlm.cli import app as registered  # the importable module carries the registered sub-commands
    registered()
