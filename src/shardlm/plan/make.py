"""The planner's front door: from a model name and devices to ranked plans, or a plan re-predicted."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardlm import hardware
from shardlm.models.inventory import parameter_count
from shardlm.models.presets import resolve_config
from shardlm.models.registry import args_for_config
from shardlm.plan.plan import DTYPES, OBJECTIVES, QUANTIZATIONS, KVBudget, ModelRef, Plan, PlanError
from shardlm.plan.predict import Setting, predict
from shardlm.plan.search import Candidate, Request, choose, enumerate_candidates
from shardlm.plan.validate import no_fit_advice


def load_model(model: str):
    """(ModelRef, Family, ModelArgs) for a preset name or a local folder."""
    cfg, name = resolve_config(model)
    family, args = args_for_config(cfg)
    return ModelRef(name, args.architecture, parameter_count(args), args.n_layers), family, args


def load_devices(devices: str | None, cluster_file: str | None) -> tuple[hardware.Cluster, str]:
    """Cluster from a shorthand, a cluster YAML, or this machine; and how it was named."""
    if devices is not None and cluster_file is not None:
        raise PlanError("give either --devices or --cluster, not both")
    if cluster_file is not None:
        return hardware.load_cluster(cluster_file), str(cluster_file)
    if devices is not None:
        return hardware.parse_devices(devices), devices
    return hardware.detect_local(hardware.read_calibration()), "local"


def cluster_for(name: str) -> hardware.Cluster:
    """The Cluster a manifest's `cluster` field names."""
    if name == "local":
        return hardware.detect_local(hardware.read_calibration())
    if name.endswith((".yaml", ".yml")):
        return hardware.load_cluster(name)
    return hardware.parse_devices(name)


@dataclass(frozen=True)
class Result:
    """What `plan` found."""

    request: Request
    """The request."""
    ranked: list[Candidate]
    """Feasible plans, best first."""
    candidates: list[Candidate]
    """Everything tried."""


def check_options(dtype: str, quantization: str, objective: str, max_batch: int, max_seq_len: int, args) -> None:
    """Raise PlanError for a value outside its allowed set, naming the allowed ones."""
    if dtype not in DTYPES:
        raise PlanError(f"--dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    if quantization not in ("auto", *QUANTIZATIONS):
        raise PlanError(f"--quantization {quantization} is not supported; use auto, {', '.join(QUANTIZATIONS)}")
    if objective not in OBJECTIVES:
        raise PlanError(f"--objective {objective} is not supported; use {' or '.join(OBJECTIVES)}")
    if max_batch < 1 or max_seq_len < 2:
        raise PlanError(f"--max-batch must be >= 1 and --max-seq-len >= 2, got {max_batch} and {max_seq_len}")
    if max_seq_len > args.max_seq_len:
        raise PlanError(f"--max-seq-len {max_seq_len} exceeds the model's {args.max_seq_len} positions; "
                        f"use at most {args.max_seq_len}")


def make_plan(req: Request) -> Result:
    """Enumerate, reject, rank; PlanError with advice when nothing fits."""
    a = req.args
    if req.tp is not None and not 1 <= req.tp <= a.n_heads:
        raise PlanError(f"--tp {req.tp} is outside 1..{a.n_heads} (the model's attention heads)")
    if req.pp is not None and not 1 <= req.pp <= a.n_layers:
        raise PlanError(f"--pp {req.pp} is outside 1..{a.n_layers} (the model's layers)")
    if req.layers is not None and (sum(req.layers) != a.n_layers or min(req.layers) < 1):
        raise PlanError(f"--layers {','.join(map(str, req.layers))} sums to {sum(req.layers)}; the model has "
                        f"{a.n_layers} layers and every stage needs at least one")
    cands = enumerate_candidates(req)
    if not cands:
        raise PlanError(f"no layout can be formed on {req.cluster.describe()} with tp={req.tp} pp={req.pp}: "
                        "a tensor-parallel group needs that many identical devices on one node")
    ranked = choose(req, cands)
    if not ranked:
        raise PlanError(no_fit_advice(req, cands))
    return Result(req, ranked, cands)


def repredict(plan: Plan) -> Plan:
    """The same plan with predictions recomputed from its model, cluster and layout (for validate; check the
    plan against its model and cluster first: manifest.check_model, manifest.check_devices)."""
    _, family, args = load_model(plan.model.name)
    cluster = cluster_for(plan.cluster)
    st = Setting(args, family.tp_plan, cluster, plan.dtype, plan.quantization, plan.kv, plan.offload,
                 plan.micro_batches, plan.embedding)
    return replace(plan, predictions=predict(st, plan.layout))


def default_kv(max_batch: int, max_seq_len: int | None, args) -> KVBudget:
    """KV budget from the flags (max_seq_len defaults to min(model positions, 4096))."""
    seq = min(args.max_seq_len, 4096) if max_seq_len is None else max_seq_len
    return KVBudget(max_batch, seq, min(seq, 2048))
