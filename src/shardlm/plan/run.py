"""The Plan of one run on this machine, from the run's flags (torch-free for CPU runs).

Flags build a Plan through the planner's own builder with every layout field fixed (`search.
fixed_candidate`): the same memory model, predictions and balance check as `shardlm plan`, applied
to the layout the user asked for. Fields the user leaves out take the runtime's defaults: tp 1, pp 1,
one micro-batch per stage, float32, no quantization, and stage ranges balanced by the planner's own
layer assignment (predicted stage time; the stages holding the embedding and the LM head get fewer
layers), falling back to an even split when the memory caps leave no balanced assignment.
`--memory-budget` decides here, once, which layers of each stage stream in (`plan.streaming`), so every rank receives its own
offloaded layers in its RankSpec instead of working them out itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import psutil

from shardlm import hardware
from shardlm.models.args import ModelArgs
from shardlm.models.registry import Family
from shardlm.parallel.split import split_sizes
from shardlm.parallel.stages import stages_from_counts
from shardlm.plan.memory import shard_weights
from shardlm.plan.plan import KVBudget, ModelRef, Offload, Plan, PlanError
from shardlm.plan.search import HEADROOM, Request, fixed_candidate
from shardlm.plan.streaming import fit_budget
from shardlm.quant_spec import QuantizationError, check_kind

RUNTIME_DTYPES = ("float32", "bfloat16")
"""Dtypes the runtime computes in."""
GiB = 2**30


@dataclass(frozen=True)
class RunFlags:
    """What the user fixed for a run; None means the runtime's default."""

    tp: int | None = None
    """Tensor-parallel degree (default 1)."""
    pp: int | None = None
    """Pipeline stages (default 1)."""
    layers: tuple[int, ...] | None = None
    """Decoder layers per stage (default: an even split)."""
    micro_batches: int | None = None
    """Micro-batches in flight through the stages (default: one per stage, capped by the batch)."""
    dtype: str = "float32"
    """Compute dtype."""
    quantization: str = "none"
    """Weight-only quantization of the linear layers at load: none, int8 or int4."""
    device: str = "cpu"
    """cpu or cuda."""
    memory_budget: int | None = None
    """Bytes of weights and read buffers per rank; the layers beyond it stream in."""
    offload_dir: str | None = None
    """Folder for streamed layers (CPU ranks)."""
    prefetch: bool = True
    """Bring the next streamed layer in while the current one computes."""
    quantize_embedding: bool = False
    """Hold the token embedding, and an LM head tied to it, as int8 rows (Plan.embedding "int8")."""

    @property
    def embedding(self) -> str:
        """Plan.embedding for these flags."""
        return "int8" if self.quantize_embedding else "float"

    @property
    def tp_degree(self) -> int:
        """The tensor-parallel degree (given or default; 0 stays 0 so that it is refused, not defaulted)."""
        return 1 if self.tp is None else self.tp

    @property
    def pp_degree(self) -> int:
        """The pipeline stages (given or default)."""
        return 1 if self.pp is None else self.pp

    @property
    def world(self) -> int:
        """Rank processes the run starts."""
        return self.tp_degree * self.pp_degree


def check_flags(flags: RunFlags, args: ModelArgs) -> None:
    """Raise PlanError for a flag this model or runtime cannot take, naming the accepted range."""
    if flags.dtype not in RUNTIME_DTYPES:
        raise PlanError(f"--dtype {flags.dtype} is not supported; use one of {', '.join(RUNTIME_DTYPES)}")
    if flags.device not in ("cpu", "cuda"):
        raise PlanError(f"--device {flags.device} is not supported; use cpu or cuda")
    try:
        check_kind(flags.quantization, flags.device)
    except QuantizationError as e:
        raise PlanError(str(e)) from e
    tp, pp = flags.tp_degree, flags.pp_degree
    if not 1 <= tp <= args.n_heads:
        raise PlanError(f"--tp {tp} is outside 1..{args.n_heads}: this model has {args.n_heads} attention heads and "
                        f"every rank needs at least one; use --tp {min(max(tp, 1), args.n_heads)}")
    if not 1 <= pp <= args.n_layers:
        raise PlanError(f"--pp {pp} is outside 1..{args.n_layers}: this model has {args.n_layers} decoder layers and "
                        f"every stage needs at least one; use --pp {min(max(pp, 1), args.n_layers)}")
    if flags.layers is not None:
        shown, even = ",".join(map(str, flags.layers)), ",".join(map(str, split_sizes(args.n_layers, pp)))
        if len(flags.layers) != pp:
            raise PlanError(f"--layers {shown} gives {len(flags.layers)} stage(s) but --pp is {pp}; give one count "
                            f"per stage, e.g. --layers {even}")
        if sum(flags.layers) != args.n_layers or min(flags.layers) < 1:
            raise PlanError(f"--layers {shown} sums to {sum(flags.layers)}; the model has {args.n_layers} decoder "
                            f"layers and every stage needs at least one, e.g. --layers {even}")
    if flags.device == "cuda" and flags.offload_dir:
        raise PlanError("--offload-dir applies to CPU ranks; on GPUs the layers beyond --memory-budget stay in "
                        "pinned host memory and stream to the GPU; drop --offload-dir")
    if not flags.memory_budget and (flags.offload_dir or not flags.prefetch):
        raise PlanError("--offload-dir and --no-prefetch only apply with --memory-budget SIZE; add it or drop them")


def check_micro_batches(micro_batches: int | None, pp: int, batch: int) -> None:
    """Raise PlanError when `micro_batches` does not fit `pp` stages and a batch of `batch` sequences."""
    if micro_batches is None:
        return
    if pp == 1:
        raise PlanError("--micro-batches only applies to pipeline parallelism; add --pp 2 or more, or drop it")
    if not 1 <= micro_batches <= batch:
        raise PlanError(f"--micro-batches {micro_batches} is outside 1..{batch}: the batch has {batch} sequence(s) "
                        f"and every micro-batch needs at least one; use --micro-batches "
                        f"{min(max(micro_batches, 1), batch)}")


def budget_offload(flags: RunFlags, family: Family, args: ModelArgs, stages: tuple[tuple[int, int], ...]) -> Offload:
    """The offload `--memory-budget` asks for: per stage, the last layers that must stream (the most any
    of its tp ranks needs) and whether its vocabulary is used in place. Offload() when all fits."""
    if not flags.memory_budget:
        return Offload()
    tp, quant = flags.tp_degree, flags.quantization
    counts, vocab = [], []
    for s, (a, b) in enumerate(stages):
        fits = [fit_budget(shard_weights(args, family.tp_plan, tp, r, flags.dtype, quant, flags.device, flags.embedding),
                           b - a, s == 0, s == len(stages) - 1, flags.memory_budget, flags.prefetch, quant != "none",
                           vocab_ok=flags.device == "cpu" and not flags.quantize_embedding) for r in range(tp)]
        counts.append(max(f.streamed for f in fits))
        vocab.append(any(f.vocab for f in fits))
    if not any(counts) and not any(vocab):
        return Offload()
    tier = "disk" if flags.device == "cpu" else "cpu"
    return Offload(tier, tuple(counts), flags.offload_dir, flags.prefetch, tuple(vocab) if any(vocab) else ())


def plan_for_run(ref: ModelRef, family: Family, args: ModelArgs, flags: RunFlags, kv: KVBudget,
                 calibration: dict | None = None) -> Plan:
    """The Plan of a run of `flags` on this machine, sized for `kv`; PlanError when the flags do not fit
    the model, or the ranks would not fit this machine's memory (with the numbers and the fix)."""
    check_flags(flags, args)
    tp, pp = flags.tp_degree, flags.pp_degree
    check_micro_batches(flags.micro_batches, pp, kv.max_batch)
    try:
        cluster = hardware.local_cluster(flags.device, tp * pp, calibration)
    except hardware.HardwareError as e:
        raise PlanError(str(e)) from e
    req = Request(ref, args, family.tp_plan, cluster, cluster.description if flags.device == "cpu" else "local",
                  flags.dtype, flags.quantization, "latency", kv, tp, pp, flags.layers,
                  micro_batches=flags.micro_batches or 0, embedding=flags.embedding)
    counts = flags.layers or balanced_counts(req) or tuple(split_sizes(args.n_layers, pp))
    req = replace(req, layers=counts)
    stages = stages_from_counts(counts)
    cand = fixed_candidate(req, budget_offload(flags, family, args, stages))
    if cand is None:  # local_cluster gives exactly tp x pp slots
        raise PlanError(f"no layout of tp {tp} x pp {pp} on {cluster.describe()}")
    plan = replace(cand.plan, device=flags.device)
    check_fits(plan)
    return plan


def balanced_counts(req: Request) -> tuple[int, ...] | None:
    """Layers per stage that balance the predicted stage times of `req`'s layout (the planner's assignment),
    or None when one stage or the memory caps leave nothing to choose."""
    if req.pp == 1:
        return None
    cand = fixed_candidate(replace(req, layers=None))
    return None if cand is None else tuple(b - a for a, b in cand.plan.layout.stage_layers)


def check_local_fit(plan: Plan, ref: ModelRef, family: Family, args: ModelArgs, kv: KVBudget,
                    calibration: dict | None = None) -> None:
    """Raise PlanError when `plan` (a manifest, made for its own cluster) would not fit this machine as it
    runs here: its layout and offload predicted on this machine's rank slots for a batch of `kv`."""
    lay = plan.layout
    try:
        cluster = hardware.local_cluster(plan.device, lay.tp * lay.pp, calibration)
    except hardware.HardwareError as e:
        if plan.device != "cuda":
            raise PlanError(str(e)) from e
        raise PlanError("the plan places its ranks on GPUs (device: cuda) but torch sees no CUDA device here (a CPU "
                        "build of torch, or no driver); run it where the GPUs are, or plan for this machine's CPU "
                        "ranks (e.g. shardlm plan MODEL --devices 2xcpu-4GB)") from e
    counts = tuple(b - a for a, b in lay.stage_layers)
    req = Request(ref, args, family.tp_plan, cluster, cluster.description, plan.dtype, plan.quantization, "latency",
                  kv, lay.tp, lay.pp, counts, micro_batches=plan.micro_batches, embedding=plan.embedding)
    cand = fixed_candidate(req, plan.offload)
    if cand is not None:
        check_fits(replace(cand.plan, device=plan.device))


def check_fits(plan: Plan) -> None:
    """Raise PlanError when a rank's predicted memory exceeds its share of this machine: host RAM for CPU
    ranks; the GPU, and host RAM for the layers pinned there, for GPU ranks."""
    memory = plan.predictions.memory
    world = len(memory)
    if plan.device == "cpu":
        need = sum(r.total for r in memory)
        have = psutil.virtual_memory().available
        if any(r.total > r.capacity * HEADROOM for r in memory):
            w = max(memory, key=lambda r: r.total)
            raise PlanError(
                f"{world} rank(s) need about {need / GiB:.1f} GiB ({world} x {w.total / GiB:.2f} GiB: weights "
                f"{w.weights / GiB:.2f}, KV cache {w.kv_cache / GiB:.2f}, activations {w.activations / GiB:.2f}, "
                f"overhead {w.overhead / GiB:.2f}) but {have / GiB:.1f} GiB is available; use fewer ranks, "
                "--dtype bfloat16, --quantization int8|int4, or stream layers from disk (--memory-budget SIZE)")
        return
    over = [r for r in memory if r.total > r.capacity * HEADROOM]
    if over:
        r = over[0]
        raise PlanError(f"rank {r.rank} needs {r.total / GiB:.2f} GiB on its GPU ({r.device_name}: weights "
                        f"{r.weights / GiB:.2f}, KV cache {r.kv_cache / GiB:.2f}, activations "
                        f"{r.activations / GiB:.2f}) but may use {HEADROOM:.0%} of {r.capacity / GiB:.1f} GiB; stream "
                        "layers from host memory (--memory-budget SIZE), use more ranks (--tp), or quantize "
                        "(--quantization int4)")
    pinned = sum(r.offloaded for r in memory) + world * hardware.CPU_DEFAULTS["runtime_bytes"]
    have = psutil.virtual_memory().available
    if pinned > have:
        raise PlanError(f"{world} GPU rank(s) need about {pinned / GiB:.1f} GiB of host memory (their processes and "
                        f"the layers pinned there) but {have / GiB:.1f} GiB is available; raise --memory-budget, "
                        "quantize (--quantization int4), or use fewer ranks")
