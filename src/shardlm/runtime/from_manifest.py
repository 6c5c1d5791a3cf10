"""Turn a manifest into generate options, refusing plainly what the runtime cannot run yet."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from shardlm import bundled
from shardlm.models.presets import PRESETS
from shardlm.plan.plan import Plan
from shardlm.runtime.session import RUNTIME_DTYPES, GenerateOptions, UserError


def _not_yet(what: str, field: str, value, fix: str) -> UserError:
    return UserError(f"{what} is not supported by the runtime yet (the manifest has {field}: {value}); {fix}")


def on_gpus(plan: Plan) -> bool | None:
    """True when the manifest places its ranks on GPUs, False on CPU workers, None when it says
    "local" (whatever the planning machine had: the run's --device decides)."""
    if plan.cluster == "local":
        return None
    return "cpu" not in plan.cluster.lower()


def check_runnable(plan: Plan, source: str, device: str = "cpu") -> None:
    """Raise UserError naming the manifest field for anything the local runtime cannot run yet on `device`."""
    lay = plan.layout
    if lay.dp > 1:
        raise _not_yet("running data-parallel replicas", "parallelism.data", lay.dp, "set parallelism.data to 1")
    if plan.offload.tier == "cpu" and device != "cuda":
        raise UserError(f"{source} streams layers from host RAM (offload.tier: cpu), which is for GPU ranks; the CPU "
                        "runtime already holds weights in host RAM. Run it with --device cuda, plan for this "
                        "machine's CPU ranks (offload.tier: disk), or set offload.tier to none")
    if plan.offload.tier == "disk" and device == "cuda":
        raise _not_yet("streaming layers from disk to GPUs", "offload.tier", "disk",
                       "plan with host-RAM offload (offload.tier: cpu) for GPU ranks, or run on CPU ranks")
    if plan.dtype not in RUNTIME_DTYPES:
        raise UserError(f"dtype {plan.dtype} in {source} is not supported by the runtime; use one of "
                        f"{', '.join(RUNTIME_DTYPES)}")
    if on_gpus(plan) is True and device != "cuda":
        raise UserError(f"{source} places ranks on {plan.cluster} GPUs; run it with --device cuda on a machine with "
                        "them, or plan for this machine's CPU ranks with --devices NxCPU-SIZE (e.g. 2xcpu-4GB)")
    if on_gpus(plan) is False and device == "cuda":
        raise UserError(f"{source} was planned for CPU ranks ({plan.cluster}) but --device cuda was given; plan for "
                        "the GPUs (e.g. --devices 1xH100-80GB) or drop --device cuda")


def model_folder(plan: Plan) -> str | None:
    """The checkpoint a manifest's model names: the bundled model for its preset, a folder as given."""
    name = plan.model.name
    if name in bundled.ALIASES:
        return None
    if Path(name).expanduser().is_dir():
        return name
    if name in PRESETS:
        raise UserError(f"the manifest's model {name} is a preset without local weights; pass --model PATH to a "
                        f"folder holding its checkpoint (config.json and safetensors)")
    raise UserError(f"the manifest's model {name} is neither a preset nor an existing folder; fix model.name")


def apply_manifest(plan: Plan, source: str, opts: GenerateOptions, given: dict[str, bool]) -> GenerateOptions:
    """`opts` with the model, tp, stages and dtype the manifest fixes; UserError for what cannot run.

    `given` says which of tp, pp and layers the user also passed on the command line: those must
    agree with the manifest.
    """
    check_runnable(plan, source, opts.device)
    lay = plan.layout
    counts = tuple(b - a for a, b in lay.stage_layers)
    fixed = {"tp": (opts.tp, lay.tp, "parallelism.tensor"), "pp": (opts.pp, lay.pp, "parallelism.pipeline"),
             "layers": (opts.layers, counts, "stages[].layers"),
             "quantization": (opts.quantization or "none", plan.quantization, "quantization")}
    for flag, (ours, theirs, field) in fixed.items():
        if given.get(flag) and ours != theirs:
            shown = ",".join(map(str, theirs)) if isinstance(theirs, tuple) else theirs
            raise UserError(f"--{flag} contradicts {source} ({field}: {shown}); drop --{flag} or edit the manifest")
    model = opts.model if opts.model else model_folder(plan)
    quant = None if plan.quantization == "none" else plan.quantization
    opts = replace(opts, model=model, tp=lay.tp, pp=lay.pp, layers=counts if lay.pp > 1 else None, dtype=plan.dtype,
                   quantization=quant)
    if plan.offload.tier == "disk" and not opts.memory_budget:  # a --memory-budget given on the command line wins
        opts = replace(opts, stream_layers=tuple(plan.offload.layers), offload_dir=opts.offload_dir or plan.offload.dir)
    elif plan.offload.tier == "cpu" and not opts.memory_budget:  # GPU ranks: the last layers stream from host RAM
        opts = replace(opts, stream_layers=tuple(plan.offload.layers))
    return opts


def check_length(plan: Plan, longest: int, source: str) -> None:
    """Raise UserError when prompt plus new tokens exceed the manifest's KV budget."""
    if longest > plan.kv.max_seq_len:
        raise UserError(f"prompt plus --max-new-tokens is {longest} tokens but {source} sizes the KV cache for "
                        f"{plan.kv.max_seq_len} (kv_cache.max_seq_len); raise it or generate fewer tokens")
