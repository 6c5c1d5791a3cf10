"""The options that say how a model runs, shared by `generate` and `serve`, and the Plan inputs they make.

Flags become RunFlags (the planner's builder fills in the rest: plan/run.py); `--manifest` replaces
them all, and a layout option given beside it is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

import typer

from shardlm.checkpoint.integrity import DEFAULT_VERIFY, VERIFY_HELP
from shardlm.cli import options as o
from shardlm.cli.common import fail, refuse_conflicts
from shardlm.plan.plan import Plan
from shardlm.plan.run import RunFlags

Model = Annotated[Optional[str], typer.Option(parser=o.ModelPath(), help="Local Hugging Face Llama-family folder (default: bundled SmolLM2-135M-Instruct).")]
Tp = Annotated[Optional[int], typer.Option("--tp", parser=o.TP, help="Tensor-parallel degree: any value from 1 to the number of attention heads (default 1).")]
Pp = Annotated[Optional[int], typer.Option("--pp", parser=o.PP, help="Pipeline stages (default 1); world = tp x pp ranks.")]
Layers = Annotated[Optional[str], typer.Option("--layers", parser=o.LayerCounts(), help="Decoder layers per stage, e.g. 20,10 (default: even).")]
MicroBatches = Annotated[Optional[int], typer.Option("--micro-batches", parser=o.MICRO_BATCHES, help="Micro-batches in flight through the stages (default: one per stage).")]
Manifest = Annotated[Optional[str], typer.Option("--manifest", parser=o.ExistingPath("file"), help="Run the plan in this manifest (from `shardlm plan`).")]
Dtype = Annotated[Optional[str], typer.Option(help="float32 (default) or bfloat16.")]
Quantization = Annotated[Optional[str], typer.Option("--quantization", help="Weight-only quantization of linear layers at load: none, int8 (per channel) or int4 (groups of 32).")]
QuantizeEmbedding = Annotated[bool, typer.Option("--quantize-embedding", help="Hold the token embedding, and an LM head tied to it, as int8 rows with a scale each (a quarter of float32's bytes, read once per token by the head); `shardlm perplexity --quantize-embedding` prints what it costs.")]
MemoryBudget = Annotated[Optional[int], typer.Option("--memory-budget", parser=o.MEMORY_BUDGET, help="Weights + read buffers per rank, e.g. 300MB; layers beyond it stream from disk.")]
OffloadDir = Annotated[Optional[str], typer.Option("--offload-dir", parser=o.NewPath("folder"), help="Folder for streamed layers (default $SHARDLM_HOME/offload).")]
NoPrefetch = Annotated[bool, typer.Option("--no-prefetch", help="Read each streamed layer only when it is needed (for comparison).")]
Verify = Annotated[str, typer.Option("--verify", help=VERIFY_HELP)]
Device = Annotated[Optional[str], typer.Option("--device", help="cpu (default), or cuda: rank r on GPU r mod the GPUs (NCCL when each rank has its own GPU; ranks sharing one use gloo). With --memory-budget, layers beyond it stay in pinned host memory.")]


@dataclass
class Layout:
    """What the layout options asked for."""

    flags: RunFlags
    given: set[str]
    """Which of them the user set (the rest are defaults)."""
    manifest: tuple[Plan, str] | None
    verify: str = DEFAULT_VERIFY


def layout_of(tp, pp, layers, micro_batches, dtype, quantization, memory_budget, offload_dir, no_prefetch, device,
              manifest, verify, quantize_embedding: bool = False) -> Layout:
    """RunFlags and the manifest from the layout options; exits with one line for a manifest that cannot be
    read or a layout option given beside it."""
    named = {"--tp": tp, "--pp": pp, "--layers": ",".join(map(str, layers)) if layers else None,
             "--micro-batches": micro_batches, "--dtype": dtype, "--quantization": quantization,
             "--memory-budget": memory_budget and f"{memory_budget // 2**20}MB", "--offload-dir": offload_dir,
             "--no-prefetch": no_prefetch, "--quantize-embedding": quantize_embedding}
    read = None
    if manifest is not None:
        from shardlm.manifest import ManifestError, read_manifest

        refuse_conflicts(named, f"--manifest {manifest}", "fixes the layout, numerics and offload")
        try:
            read = read_manifest(manifest), manifest
        except ManifestError as e:
            fail(str(e))
    given = {k.lstrip("-").replace("-", "_") for k, v in {**named, "--device": device}.items()
             if v is not None and v is not False}
    flags = RunFlags(tp, pp, layers, micro_batches, dtype or "float32", "none" if quantization is None else quantization,
                     device or "cpu", memory_budget, offload_dir, not no_prefetch, quantize_embedding)
    return Layout(flags, given, read, verify)
