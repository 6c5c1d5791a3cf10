"""One `generate` job end to end: settle the Plan, check everything that can be checked, run, summarize.

The Plan comes from one of three places, and nothing after this module asks which:
- a manifest (`--manifest`): the plan as written, on the device kind it names;
- a per-rank checkpoint's recorded plan, when no layout flag is given (its layout; its dtype and
  quantization unless the flags set them);
- the flags, through the planner's builder (`plan.run.plan_for_run`), sized for this batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from shardlm import bundled
from shardlm.checkpoint.check import check_checkpoint
from shardlm.checkpoint.contain import check_folder_entries
from shardlm.checkpoint.headers import CheckpointError
from shardlm.checkpoint.integrity import DEFAULT_VERIFY
from shardlm.checkpoint.sharded import ShardedInfo, check_layout, is_sharded, read_info
from shardlm.checkpoint.verify import check_before_use
from shardlm.engine.checks import UserError, check_budget, check_runnable, for_device, model_folder
from shardlm.engine.engine import GenerateResult, LocalEngine
from shardlm.engine.requests import TokenEvent
from shardlm.engine.text import encode_prompts, load_tokenizer, pad_id, unicode_problem
from shardlm.manifest import ManifestError, check_model
from shardlm.models.args import ModelConfigError
from shardlm.models.inventory import parameter_count
from shardlm.models.registry import require_runnable
from shardlm.models.source import ModelSource
from shardlm.plan.plan import KVBudget, ModelRef, Plan, PlanError
from shardlm.plan.run import RunFlags, check_local_fit, plan_for_run
from shardlm.runtime.protocol import SamplingParams
from shardlm.settings import Settings

GENERATE_PREFILL_TOKENS = 2048
"""A batch job prefills up to this many prompt tokens per step (all of its prompts when they fit)."""


@dataclass(frozen=True)
class GenerateRequest:
    """What to generate, besides how the model is laid out."""

    prompts: list[str]
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    chat: bool = False
    """Wrap each prompt as a user turn with the chat template."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (benchmarks, load tests)."""


@dataclass
class Job:
    """A checked generate job: the Plan that runs, the model, its tokenizer and the tokenized prompts."""

    plan: Plan
    source: ModelSource
    request: GenerateRequest
    tokenizer: object
    prompt_ids: list[list[int]]


def open_model(model: str | None) -> ModelSource:
    """The model a run uses (a folder, or the bundled model for None / its alias): its config, read only after
    every entry of the folder is found inside it. Its data is verified later (check_files), once the plan
    says the model fits: a model too large for the machine is refused before its files are hashed."""
    try:
        folder = bundled.resolve_model(model)
        check_folder_entries(folder)
        source = ModelSource.open(folder)
        require_runnable(source.family, source.args)
    except (bundled.BundledModelError, ModelConfigError, CheckpointError) as e:
        raise UserError(str(e)) from e
    return source


def model_ref(source: ModelSource) -> ModelRef:
    """The plan's description of the model in `source`."""
    a = source.args
    return ModelRef(source.folder, a.architecture, parameter_count(a), a.n_layers)


def plan_run(model: str | None = None, flags: RunFlags = RunFlags(), kv: KVBudget | None = None,
             given: set[str] = frozenset(), verify: str = DEFAULT_VERIFY,
             manifest: tuple[Plan, str] | None = None) -> tuple[Plan, ModelSource]:
    """The Plan that runs for `flags` (or `manifest`, a read manifest and its path) on `model` (None: the
    bundled model, or the manifest's), sized for `kv` (default: one sequence of up to 4096 tokens; a
    manifest keeps its own), and the model; UserError for what cannot run. A per-rank checkpoint's
    recorded layout is used unless `given` names a layout flag."""
    if manifest is not None and model is None:
        model = model_folder(manifest[0])
    source = open_model(model)
    seq = min(source.args.max_seq_len, 4096)
    kv = manifest[0].kv if manifest is not None else kv or KVBudget(1, seq, min(seq, 2048))
    if kv.max_seq_len > source.args.max_seq_len:
        if "max_seq_len" in given or manifest is not None:
            raise UserError(f"a KV budget of {kv.max_seq_len} tokens per sequence exceeds the model's "
                            f"{source.args.max_seq_len} positions; use at most {source.args.max_seq_len}")
        kv = replace(kv, max_seq_len=source.args.max_seq_len, prefill_chunk=min(kv.prefill_chunk,
                                                                                 source.args.max_seq_len))
    plan = settle_plan(source, flags, set(given), kv, manifest)
    check_files(plan, source, verify)
    return plan, source


def recorded_flags(info: ShardedInfo, flags: RunFlags, given: set[str]) -> RunFlags:
    """`flags` with the layout of a per-rank checkpoint (and, unless given, its recorded dtype, quantization
    and micro-batches)."""
    counts = tuple(b - a for a, b in info.stage_layers)
    recorded = info.plan or {}
    extra = {}
    for name, key in (("dtype", "dtype"), ("quantization", "quantization")):
        if name not in given and isinstance(recorded.get(key), str):
            extra[name] = recorded[key]
    mb = (recorded.get("parallelism") or {}).get("micro_batches")
    if "micro_batches" not in given and isinstance(mb, int) and mb > 0 and len(counts) > 1:
        extra["micro_batches"] = mb
    return replace(flags, tp=info.tp, pp=len(counts), layers=counts if len(counts) > 1 else None, **extra)


def settle_plan(source: ModelSource, flags: RunFlags, given: set[str], kv: KVBudget,
                manifest: tuple[Plan, str] | None) -> Plan:
    """The Plan this run executes (see the module docstring); UserError for anything it cannot run."""
    folder = Path(source.folder)
    try:
        if manifest is not None:
            plan, path = manifest
            check_model(plan, model_ref(source), path)  # a manifest made for another model stops here
            plan = for_device(plan, flags.device if "device" in given else None, path)
            check_runnable(plan, path)
            check_budget(plan, kv.max_seq_len, path)
            check_local_fit(plan, model_ref(source), source.family, source.args, kv)
            return plan
        layout_given = bool(given & {"tp", "pp", "layers"})
        if is_sharded(folder) and not layout_given:
            flags = recorded_flags(read_info(folder), flags, given)
        if source.quantization and "quantization" not in given:
            flags = replace(flags, quantization=source.quantization)
        return plan_for_run(model_ref(source), source.family, source.args, flags, kv)
    except (PlanError, CheckpointError, ManifestError) as e:
        raise UserError(str(e)) from e


def check_files(plan: Plan, source: ModelSource, verify: str = DEFAULT_VERIFY) -> None:
    """The checkpoint verified in mode `verify` (checkpoint/verify.py check_before_use), then its headers
    against config.json (an ordinary checkpoint) or its layout against the plan (per-rank files)."""
    folder = Path(source.folder)
    try:
        check_before_use(folder, verify)
    except CheckpointError as e:
        raise UserError(str(e)) from e
    stored, asked = source.quantization, None if plan.quantization == "none" else plan.quantization
    if stored and asked and asked != stored:
        raise UserError(f"{folder} holds {stored} weights (quantization_config in config.json); --quantization "
                        f"{asked} cannot change them: drop the flag, or give the float checkpoint")
    try:
        if is_sharded(folder):
            check_layout(folder, plan.layout.tp, plan.layout.stage_layers, source.args.n_layers)
        else:
            check_checkpoint(folder, source.family, source.args)
    except (ModelConfigError, CheckpointError) as e:
        raise UserError(str(e)) from e
    if plan.offload.tier == "disk":
        check_offload_dir(plan.offload.dir)


def check_offload_dir(folder: str | None, settings: Settings | None = None) -> None:
    """Raise UserError unless streamed layers can be written to `folder` (created if missing)."""
    path = Path(folder) if folder else (settings or Settings.from_env()).offload_dir
    probe = path / f".shardlm-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise UserError(f"--offload-dir {path} is not writable ({e.strerror}); give a folder on a local disk this "
                        "user can write, with room for the streamed layers") from e


def prepare(request: GenerateRequest, model: str | None, flags: RunFlags, given: set[str],
            manifest: tuple[Plan, str] | None = None, verify: str = DEFAULT_VERIFY) -> Job:
    """Validate everything that can be checked before a rank starts; raises UserError.

    `given` names the flags the user set (the rest are defaults); `manifest` is a read manifest and its path.
    """
    if not request.prompts or any(not p.strip() for p in request.prompts):
        raise UserError("empty prompt: give at least one non-empty PROMPT, e.g. shardlm generate \"Hello\"")
    for i, p in enumerate(request.prompts):
        if problem := unicode_problem(p):
            raise UserError(f"prompt {i + 1} is {problem}; pass prompts as UTF-8 text (check the shell's locale, "
                            "or the encoding of the file they come from)")
    if manifest is not None and model is None:
        model = model_folder(manifest[0])
    source = open_model(model)
    batch = len(request.prompts)
    # the layout, the memory and the files are checked first, with the least KV cache the request needs
    check_files(settle_plan(source, flags, given, KVBudget(batch, request.max_new_tokens + 1, 1), manifest), source,
                verify)
    try:
        tok = load_tokenizer(Path(source.folder))
        ids = encode_prompts(tok, request.prompts, request.chat)
    except (ModelConfigError, CheckpointError) as e:
        raise UserError(str(e)) from e
    longest = max(len(i) for i in ids) + request.max_new_tokens
    if longest > source.args.max_seq_len:
        raise UserError(f"prompt plus --max-new-tokens is {longest} tokens but the model allows "
                        f"{source.args.max_seq_len}; shorten the prompt or lower --max-new-tokens")
    widest = max(len(i) for i in ids)  # every prompt prefills in the first step (one forward pass, padded rows)
    chunk = max(widest, min(sum(len(i) for i in ids), GENERATE_PREFILL_TOKENS))
    plan = settle_plan(source, flags, given, KVBudget(batch, longest, chunk), manifest)
    return Job(plan, source, request, tok, ids)


def run_generate(job: Job, on_event: Callable[[int, TokenEvent], None] | None = None,
                 settings: Settings | None = None) -> tuple[GenerateResult, dict]:
    """Start the plan's ranks, generate every prompt as a request of one engine, stop them; returns the
    result and a JSON-ready summary. `on_event(i, event)` sees prompt i's text as it comes."""
    plan, req, tok = job.plan, job.request, job.tokenizer
    with LocalEngine(plan, job.source, settings or Settings.from_env(), tokenizer=tok) as engine:
        result = engine.generate(job.prompt_ids, req.max_new_tokens, req.sampling, pad_id(tok), on_event=on_event,
                                 ignore_eos=req.ignore_eos)
        load_s, ready, m = engine.load_s, engine.ready, engine.micro_batches(len(job.prompt_ids))
    return result, summarize(job, result, load_s, ready, m)


def summarize(job: Job, result: GenerateResult, load_s: float, ready: list[dict], micro_batches: int) -> dict:
    """The --json summary of a finished job: layout, texts, tokens, timings and every rank's figures."""
    plan, tok = job.plan, job.tokenizer
    lay = plan.layout
    specs = [plan.rank_spec(r) for r in range(plan.world)]
    return {
        "model": job.source.folder, "tp": lay.tp, "pp": lay.pp, "dtype": plan.dtype, "device": plan.device,
        "quantization": plan.quantization, "embedding": plan.embedding, "stages": [list(r) for r in lay.stage_layers],
        "micro_batches": micro_batches,
        "text": [tok.decode(t, skip_special_tokens=True) for t in result.token_ids], "token_ids": result.token_ids,
        "timings": {
            "load_s": load_s,
            "prefill_tokens_per_s": result.prompt_tokens / max(result.prefill_s, 1e-9),
            "decode_tokens_per_s": result.decode_tokens / max(result.decode_s, 1e-9) if result.decode_tokens else None,
        },
        "ranks": [{"rank": s.rank, "stage": s.stage, "tp_rank": s.tp_rank, "device": ready[s.rank].get("device", "cpu"),
                   "peak_rss_bytes": rep["peak_rss_bytes"], "peak_gpu_bytes": rep.get("peak_gpu_bytes"),
                   "weight_bytes": ready[s.rank]["weight_bytes"], "kernels": ready[s.rank]["kernels"],
                   "rss_before_load_bytes": ready[s.rank]["rss_before_load_bytes"], "load_s": ready[s.rank]["load_s"],
                   "comms": rep["comms"], **_streaming(ready[s.rank], rep, result)}
                  for s, rep in zip(specs, result.ranks)],
    }


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


__all__ = ["GenerateRequest", "Job", "UserError", "plan_run", "prepare", "run_generate", "summarize"]
