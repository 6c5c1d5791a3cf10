"""One `generate` job end to end: validate the request, start the ranks, run, summarize."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from shardlm import bundled
from shardlm.checkpoint.check import check_checkpoint
from shardlm.checkpoint.source import CheckpointError
from shardlm.models.args import ModelArgs, ModelConfigError, read_config
from shardlm.models.inventory import parameter_count
from shardlm.models.registry import Family, args_for_config, require_runnable
from shardlm.plan.memory import DTYPE_BYTES
from shardlm.runtime.engine import GenerateResult, LocalEngine
from shardlm.runtime.sampling import SamplingParams
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


def weight_bytes(args: ModelArgs, dtype: str) -> int:
    """Bytes of all parameters of the model in `dtype` (tied embeddings once), from the tensor inventory."""
    return parameter_count(args) * DTYPE_BYTES[dtype]


def check_request(opts: GenerateOptions, family: Family, args: ModelArgs) -> None:
    """Raise UserError for a request this model or machine cannot run, naming the fix."""
    if not opts.prompts or any(not p.strip() for p in opts.prompts):
        raise UserError("empty prompt: give at least one non-empty PROMPT, e.g. shardlm generate \"Hello\"")
    if opts.dtype not in RUNTIME_DTYPES:
        raise UserError(f"--dtype {opts.dtype} is not supported; use one of {', '.join(RUNTIME_DTYPES)}")
    if opts.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {opts.max_new_tokens}")
    try:
        opts.sampling.validate()
    except ValueError as e:
        raise UserError(str(e)) from e
    if not 1 <= opts.tp <= args.n_heads:
        raise UserError(f"--tp {opts.tp} is outside 1..{args.n_heads}: this model has {args.n_heads} attention "
                        f"heads and every rank needs at least one; use --tp {min(max(opts.tp, 1), args.n_heads)}")
    weights = weight_bytes(args, opts.dtype)
    need = weights + opts.tp * RANK_OVERHEAD_BYTES
    have = psutil.virtual_memory().available
    if need > have:
        raise UserError(f"--tp {opts.tp} needs about {need / 2**30:.1f} GiB ({opts.tp} ranks x "
                        f"{RANK_OVERHEAD_BYTES / 2**20:.0f} MiB overhead + {weights / 2**30:.1f} GiB "
                        f"weights) but {have / 2**30:.1f} GiB is available; use a smaller --tp or --dtype bfloat16")


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
    check_request(opts, family, args)
    try:
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
    """Start `tp` ranks, generate, stop them; returns the result and a JSON-ready summary."""
    opts, tok = job.opts, job.tokenizer
    with LocalEngine(str(job.folder), job.family.name, job.args, tp=opts.tp, dtype=opts.dtype) as engine:
        result = engine.generate(job.prompt_ids, opts.max_new_tokens, opts.sampling, pad_id(tok), on_token=on_token,
                                 ignore_eos=opts.ignore_eos)
        load_s, ready = engine.load_s, engine.ready
    texts = [tok.decode(t, skip_special_tokens=True) for t in result.token_ids]
    summary = {
        "model": str(job.folder), "tp": opts.tp, "dtype": opts.dtype,
        "text": texts, "token_ids": result.token_ids,
        "timings": {
            "load_s": load_s,
            "prefill_tokens_per_s": result.prompt_tokens / max(result.prefill_s, 1e-9),
            "decode_tokens_per_s": result.decode_tokens / max(result.decode_s, 1e-9) if result.decode_tokens else None,
        },
        "ranks": [{"rank": r, "peak_rss_bytes": rep["peak_rss_bytes"], "weight_bytes": ready[r]["weight_bytes"],
                   "rss_before_load_bytes": ready[r]["rss_before_load_bytes"], "load_s": ready[r]["load_s"],
                   "comms": rep["comms"]} for r, rep in enumerate(result.ranks)],
    }
    return result, summary
