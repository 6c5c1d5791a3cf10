"""What the local runtime can run of a Plan, refused plainly by manifest field before any rank starts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from shardlm import bundled
from shardlm.models.presets import PRESETS
from shardlm.plan.plan import Plan, PlanError
from shardlm.plan.run import RUNTIME_DTYPES


class UserError(ValueError):
    """A problem with what the user asked for; the CLI prints it on one line and exits with 2."""


def _not_yet(what: str, field: str, value, fix: str) -> UserError:
    return UserError(f"{what} is not supported by the runtime yet (the manifest has {field}: {value}); {fix}")


def for_device(plan: Plan, device: str | None, source: str) -> Plan:
    """`plan` on the device kind it runs on: a "local" plan takes the run's --device (default cpu); any
    other plan keeps its own, and a --device that contradicts it is refused."""
    if plan.cluster == "local":
        return replace(plan, device=device or "cpu")
    if device is not None and device != plan.device:
        where = f"{plan.cluster} GPUs" if plan.device == "cuda" else f"CPU ranks ({plan.cluster})"
        raise UserError(f"{source} places its ranks on {where} (device: {plan.device}) but --device {device} was "
                        f"given; drop --device, or plan for the other devices (e.g. --devices 1xH100-80GB or "
                        "--devices 2xcpu-4GB)")
    return plan


def check_runnable(plan: Plan, source: str) -> None:
    """Raise UserError naming the manifest field for anything the local runtime cannot run yet."""
    lay = plan.layout
    if lay.dp > 1:
        raise _not_yet("running data-parallel replicas", "parallelism.data", lay.dp, "set parallelism.data to 1")
    if plan.offload.tier == "cpu" and plan.device != "cuda":
        raise UserError(f"{source} streams layers from host RAM (offload.tier: cpu), which is for GPU ranks; the CPU "
                        "runtime already holds weights in host RAM. Run it with --device cuda, plan for this "
                        "machine's CPU ranks (offload.tier: disk), or set offload.tier to none")
    if plan.offload.tier == "disk" and plan.device == "cuda":
        raise _not_yet("streaming layers from disk to GPUs", "offload.tier", "disk",
                       "plan with host-RAM offload (offload.tier: cpu) for GPU ranks, or run on CPU ranks")
    if plan.dtype not in RUNTIME_DTYPES:
        raise UserError(f"dtype {plan.dtype} in {source} is not supported by the runtime; use one of "
                        f"{', '.join(RUNTIME_DTYPES)}")


def model_folder(plan: Plan) -> str | None:
    """The checkpoint a manifest's model names: None for the bundled model, a folder as given."""
    name = plan.model.name
    if name in bundled.ALIASES:
        return None
    if Path(name).expanduser().is_dir():
        return name
    if name in PRESETS:
        raise UserError(f"the manifest's model {name} is a preset without local weights; pass --model PATH to a "
                        f"folder holding its checkpoint (config.json and safetensors)")
    raise UserError(f"the manifest's model {name} is neither a preset nor an existing folder; fix model.name")


def check_budget(plan: Plan, longest: int, source: str) -> None:
    """Raise UserError when a sequence of `longest` tokens exceeds the plan's KV budget (more prompts than
    kv_cache.max_batch are not an error: they wait for a free slot)."""
    if longest > plan.kv.max_seq_len:
        raise UserError(f"prompt plus --max-new-tokens is {longest} tokens but {source} sizes the KV cache for "
                        f"{plan.kv.max_seq_len} (kv_cache.max_seq_len); raise it or generate fewer tokens")


__all__ = ["PlanError", "UserError", "check_budget", "check_runnable", "for_device", "model_folder"]
