"""One `generate` job end to end: validate the request, start the ranks, run, summarize."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import psutil

from shardlm import bundled
from shardlm.checkpoint.check import check_checkpoint
from shardlm.checkpoint.sharded import check_layout, is_sharded
from shardlm.checkpoint.headers import CheckpointError
from shardlm.checkpoint.integrity import DEFAULT_VERIFY
from shardlm.checkpoint.verify import check_before_use
from shardlm.models.args import ModelArgs, ModelConfigError, read_config
from shardlm.models.inventory import tensor_inventory
from shardlm.models.registry import Family, args_for_config, require_runnable
from shardlm.parallel.stages import auto_micro_batches, even_stages, stages_from_counts
from shardlm.parallel.split import split_sizes
from shardlm.paths import default_offload_dir
from shardlm.plan.memory import tensor_bytes
from shardlm.quant_spec import QuantizationError, check_kind, checkpoint_quantization
from shardlm.runtime.engine import GenerateResult, LocalEngine
from shardlm.runtime.messages import SamplingParams
from shardlm.runtime.text import encode_prompts, load_tokenizer, pad_id

RANK_OVERHEAD_BYTES = 450 * 2**20
"""Resident memory of one rank besides its weights (Python, torch, gloo); measured ~400 MB here."""
RUNTIME_DTYPES = ("float32", "bfloat16")
"""Dtypes the CPU runtime computes in."""


class UserError(ValueError):
    """A problem with what the user asked for; the CLI prints it on one line and exits with 2."""


@dataclass(frozen=True)
class GenerateOptions:
    """What the user asked `shardlm generate` to do."""

    prompts: list[str]
    model: str | None = None
    tp: int = 1
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    dtype: str = "float32"
    chat: bool = False
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (benchmarks, load tests)."""
    pp: int = 1
    """Pipeline stages."""
    layers: tuple[int, ...] | None = None
    """Decoder layers per stage (e.g. (20, 10)); None splits them evenly."""
    micro_batches: int | None = None
    """Micro-batches in flight through the stages; None picks one per stage (capped by the batch)."""
    quantization: str | None = None
    """Weight-only quantization of the linear layers at load: None, "int8" or "int4"."""
    memory_budget: int | None = None
    """Bytes of weights and read buffers per rank; the layers beyond it stream from disk."""
    offload_dir: str | None = None
    """Folder for streamed layers (default $SHARDLM_HOME/offload)."""
    prefetch: bool = True
    """Read the next streamed layer while the current one computes."""
    stream_layers: tuple[int, ...] = ()
    """Per stage, how many of its last layers stream from disk (from a manifest's offload.layers)."""
    device: str = "cpu"
    """"cpu" or "cuda" (rank r on GPU r mod the GPUs; NCCL when every rank has its own GPU)."""
    verify: str = DEFAULT_VERIFY
    """How much of the checkpoint is checked before a rank starts (checkpoint.integrity.VERIFY_MODES)."""

    @property
    def world(self) -> int:
        """Rank processes this request starts."""
        return self.tp * self.pp

    def stage_layers(self, n_layers: int) -> tuple[tuple[int, int], ...]:
        """[start, stop) layers of each stage (empty without pipeline parallelism)."""
        if self.pp == 1:
            return ()
        return stages_from_counts(self.layers) if self.layers else even_stages(n_layers, self.pp)

    def micro_batch_count(self) -> int:
        """The micro-batches to use: as given, or one per stage capped by the batch."""
        if self.pp == 1:
            return 1
        return self.micro_batches or auto_micro_batches(len(self.prompts), self.pp)


def weight_bytes(args: ModelArgs, dtype: str, quantization: str | None = None) -> int:
    """Bytes of all parameters of the model in `dtype` (tied embeddings once), linear weights
    quantized as asked, from the tensor inventory."""
    quant = quantization or "none"
    return sum(tensor_bytes(t, t.shape, dtype, quant) for t in tensor_inventory(args))


def check_request(opts: GenerateOptions, family: Family, args: ModelArgs) -> None:
    """Raise UserError for a request this model or machine cannot run, naming the fix."""
    if not opts.prompts or any(not p.strip() for p in opts.prompts):
        raise UserError("empty prompt: give at least one non-empty PROMPT, e.g. shardlm generate \"Hello\"")
    if opts.dtype not in RUNTIME_DTYPES:
        raise UserError(f"--dtype {opts.dtype} is not supported; use one of {', '.join(RUNTIME_DTYPES)}")
    if opts.device not in ("cpu", "cuda"):
        raise UserError(f"--device {opts.device} is not supported; use cpu or cuda")
    try:
        check_kind(opts.quantization, opts.device)
    except QuantizationError as e:
        raise UserError(str(e)) from e
    if opts.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {opts.max_new_tokens}")
    try:
        opts.sampling.validate()
    except ValueError as e:
        raise UserError(str(e)) from e
    if not 1 <= opts.tp <= args.n_heads:
        raise UserError(f"--tp {opts.tp} is outside 1..{args.n_heads}: this model has {args.n_heads} attention "
                        f"heads and every rank needs at least one; use --tp {min(max(opts.tp, 1), args.n_heads)}")
    check_stages(opts, args)
    weights = weight_bytes(args, opts.dtype, opts.quantization)
    streaming = opts.memory_budget or opts.stream_layers
    if opts.device == "cuda":
        if opts.offload_dir:
            raise UserError("--offload-dir applies to CPU ranks; on GPUs the layers beyond --memory-budget stay in "
                            "pinned host memory and stream to the GPU; drop --offload-dir")
        # weights go to the GPUs; host memory holds only the layers streamed from it (pinned)
        if opts.memory_budget:
            weights = max(0, weights - opts.world * opts.memory_budget)
        else:
            weights = weights * sum(opts.stream_layers) // max(1, args.n_layers)
    elif streaming:
        if opts.memory_budget:
            weights = min(weights, opts.world * opts.memory_budget)
        check_offload_dir(opts.offload_dir)
    if not streaming and (opts.offload_dir or not opts.prefetch):
        raise UserError("--offload-dir and --no-prefetch only apply with --memory-budget SIZE; add it or drop them")
    need = weights + opts.world * RANK_OVERHEAD_BYTES
    have = psutil.virtual_memory().available
    if need > have:
        raise UserError(f"{opts.world} ranks need about {need / 2**30:.1f} GiB ({opts.world} ranks x "
                        f"{RANK_OVERHEAD_BYTES / 2**20:.0f} MiB overhead + {weights / 2**30:.1f} GiB "
                        f"weights) but {have / 2**30:.1f} GiB is available; use fewer ranks or --dtype bfloat16")


def check_offload_dir(folder: str | None) -> None:
    """Raise UserError unless streamed layers can be written to `folder` (created if missing)."""
    path = Path(folder) if folder else default_offload_dir()
    probe = path / f".shardlm-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise UserError(f"--offload-dir {path} is not writable ({e.strerror}); give a folder on a local disk this "
                        "user can write, with room for the streamed layers") from e


def check_stages(opts: GenerateOptions, args: ModelArgs) -> None:
    """Raise UserError when --pp, --layers or --micro-batches do not fit the model or the batch."""
    if not 1 <= opts.pp <= args.n_layers:
        raise UserError(f"--pp {opts.pp} is outside 1..{args.n_layers}: this model has {args.n_layers} decoder layers "
                        f"and every stage needs at least one; use --pp {min(max(opts.pp, 1), args.n_layers)}")
    if opts.layers is not None:
        shown = ",".join(map(str, opts.layers))
        if len(opts.layers) != opts.pp:
            raise UserError(f"--layers {shown} gives {len(opts.layers)} stage(s) but --pp is {opts.pp}; "
                            f"give one count per stage, e.g. --layers {','.join(map(str, split_sizes(args.n_layers, opts.pp)))}")
        if sum(opts.layers) != args.n_layers or min(opts.layers) < 1:
            raise UserError(f"--layers {shown} sums to {sum(opts.layers)}; the model has {args.n_layers} decoder layers "
                            f"and every stage needs at least one, e.g. --layers "
                            f"{','.join(map(str, split_sizes(args.n_layers, opts.pp)))}")
    if opts.micro_batches is not None:
        n = len(opts.prompts)
        if opts.pp == 1:
            raise UserError("--micro-batches only applies to pipeline parallelism; add --pp 2 or more, or drop it")
        if not 1 <= opts.micro_batches <= n:
            raise UserError(f"--micro-batches {opts.micro_batches} is outside 1..{n}: the batch has {n} prompt(s) and "
                            f"every micro-batch needs at least one; use --micro-batches {min(max(opts.micro_batches, 1), n)}")


def resolve(opts: GenerateOptions) -> tuple[Path, Family, ModelArgs]:
    """Model folder, family and args for the request (the bundled model when none is given)."""
    try:
        folder = bundled.resolve_model(opts.model)
        family, args = args_for_config(read_config(folder))
        require_runnable(family, args)
    except (bundled.BundledModelError, ModelConfigError) as e:
        raise UserError(str(e)) from e
    return folder, family, args


@dataclass
class Prepared:
    """A validated request: the model, its tokenizer and the tokenized prompts."""

    opts: GenerateOptions
    folder: Path
    family: Family
    args: ModelArgs
    tokenizer: object
    prompt_ids: list[list[int]]


def prepare(opts: GenerateOptions) -> Prepared:
    """Validate everything that can be checked before a rank starts; raises UserError."""
    folder, family, args = resolve(opts)
    try:
        stored = checkpoint_quantization(read_config(folder))
    except ModelConfigError as e:
        raise UserError(str(e)) from e
    if stored and opts.quantization and opts.quantization != stored:
        raise UserError(f"{folder} holds {stored} weights (quantization_config in config.json); --quantization "
                        f"{opts.quantization} cannot change them: drop the flag, or give the float checkpoint")
    if stored:
        opts = replace(opts, quantization=stored)
    check_request(opts, family, args)
    try:
        check_before_use(folder, opts.verify)
        if is_sharded(folder):
            check_layout(folder, opts.tp, opts.stage_layers(args.n_layers), args.n_layers)
        else:
            check_checkpoint(folder, family, args)
        tok = load_tokenizer(folder)
        ids = encode_prompts(tok, opts.prompts, opts.chat)
    except (ModelConfigError, CheckpointError) as e:
        raise UserError(str(e)) from e
    longest = max(len(i) for i in ids) + opts.max_new_tokens
    if longest > args.max_seq_len:
        raise UserError(f"prompt plus --max-new-tokens is {longest} tokens but the model allows {args.max_seq_len}; "
                        "shorten the prompt or lower --max-new-tokens")
    return Prepared(opts, folder, family, args, tok, ids)


def run_generate(job: Prepared, on_token: Callable[[list[int]], None] | None = None) -> tuple[GenerateResult, dict]:
    """Start tp x pp ranks, generate, stop them; returns the result and a JSON-ready summary."""
    opts, tok = job.opts, job.tokenizer
    stages = opts.stage_layers(job.args.n_layers)
    m = opts.micro_batch_count()
    with LocalEngine(str(job.folder), job.family.name, job.args, tp=opts.tp, stage_layers=stages,
                     dtype=opts.dtype, quantization=opts.quantization, memory_budget=opts.memory_budget,
                     offload_dir=opts.offload_dir, prefetch=opts.prefetch, stream_layers=opts.stream_layers,
                     device=opts.device) as engine:
        result = engine.generate(job.prompt_ids, opts.max_new_tokens, opts.sampling, pad_id(tok), on_token=on_token,
                                 ignore_eos=opts.ignore_eos, micro_batches=m)
        load_s, ready = engine.load_s, engine.ready
    texts = [tok.decode(t, skip_special_tokens=True) for t in result.token_ids]
    summary = {
        "model": str(job.folder), "tp": opts.tp, "pp": opts.pp, "dtype": opts.dtype, "device": opts.device,
        "quantization": opts.quantization or "none",
        "stages": [list(r) for r in stages] or [[0, job.args.n_layers]], "micro_batches": m,
        "text": texts, "token_ids": result.token_ids,
        "timings": {
            "load_s": load_s,
            "prefill_tokens_per_s": result.prompt_tokens / max(result.prefill_s, 1e-9),
            "decode_tokens_per_s": result.decode_tokens / max(result.decode_s, 1e-9) if result.decode_tokens else None,
        },
        "ranks": [{"rank": r, "stage": r // opts.tp, "tp_rank": r % opts.tp, "device": ready[r].get("device", "cpu"),
                   "peak_rss_bytes": rep["peak_rss_bytes"], "peak_gpu_bytes": rep.get("peak_gpu_bytes"),
                   "weight_bytes": ready[r]["weight_bytes"], "rss_before_load_bytes": ready[r]["rss_before_load_bytes"], "load_s": ready[r]["load_s"],
                   "comms": rep["comms"], **_streaming(ready[r], rep, result)} for r, rep in enumerate(result.ranks)],
    }
    return result, summary


def _streaming(ready: dict, report: dict, result: GenerateResult) -> dict:
    """A rank's offload figures for --json: resident bytes, streamed layers, bytes per step, hit rate."""
    stream = report.get("streaming")
    out = {"resident_bytes": ready["weight_bytes"], "streamed_layers": ready.get("streamed_layers", [])}
    if stream:
        tokens = sum(len(t) for t in result.token_ids)
        out.update({"streamed_bytes_per_step": ready["streamed_bytes_per_step"],
                    "streamed_bytes": stream["bytes_read"],
                    "streamed_bytes_per_token": stream["bytes_read"] / max(1, tokens),
                    "prefetch_hit_rate": stream["hit_rate"], "prefetch_wait_s": stream["wait_s"],
                    "page_cache_hit_rate": stream["page_cache_hits"] / max(1, stream["reads"])})
    return out
