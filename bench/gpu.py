"""GPU benchmark: shardlm on one CUDA rank against transformers, and host-RAM offload against Accelerate.

    python bench/gpu.py --out gpu.json          (on a machine with a CUDA GPU; a few minutes)
    python bench/gpu.py --report gpu.json [offload.json]   (anywhere: writes the section of bench/RESULTS.md)

The runs recorded in RESULTS.md are kept in bench/gpu-runs/ (the JSON as the GPU machine wrote it).

Weights are random (models/random.py) with the published configs of SmolLM2-135M and Llama-3.2-1B,
written on the GPU machine itself: no download, and speed does not depend on the values.

Measured after a full-length warm-up of each system, systems alternating within each round,
medians over --rounds (5):
  floors   device-to-device copy bandwidth (bytes read + written, 2 GiB buffers) and pinned and
           pageable host-to-device bandwidth (1 GiB), each the best of 5 after a warm-up
  decode   batch 1, a 40-token prompt, --new-tokens greedy tokens, EOS ignored. Decode time is
           wall(generate N) - wall(generate 1) for both systems, synchronized, over N - 1 tokens.
           shardlm: build_rank_model on cuda:0 + runtime.step.generate (the rank's own code path,
           in this process), decode steps as CUDA graph replays, and "shardlm eager" without them.
           transformers: AutoModelForCausalLM on cuda:0, generate() with its defaults (sdpa
           attention, no compile, no static cache). Floor: weight bytes / copy bandwidth.
  offload  a GPU budget of a fraction of the weights, the rest in host RAM: SmolLM2-135M float32 at
           30 % and Llama-3.2-1B bfloat16 at 40 % (not 25 %: the embedding, which is also the tied
           LM head, and two layer buffers must be on the GPU, 26 % and 31 % of these models).
           shardlm with prefetch (side stream, pinned, double-buffered), without, and Accelerate
           (device_map="auto", max_memory={0: budget, "cpu": ...}, its CPU offload hooks; 3 rounds,
           its rate varies by under 5 % between rounds). Floor: bytes streamed per token / pinned host-to-device bandwidth.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpu_shardlm import Shardlm
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint

PROMPT_LEN = 40
HEADING = "## GPU: decode and host-RAM offload (bench/gpu.py)"


def _best(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def floors() -> dict:
    """Copy and host-to-device bandwidths in bytes/s."""
    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy = 2 * n / _best(lambda: dst.copy_(src))
    src = dst = None  # free 4 GiB before the next buffers
    torch.cuda.empty_cache()
    m = 2**30
    pinned = torch.empty(m, dtype=torch.uint8, pin_memory=True).random_()
    pageable = torch.empty(m, dtype=torch.uint8).random_()
    dev = torch.empty(m, dtype=torch.uint8, device="cuda")
    h2d_pinned = m / _best(lambda: dev.copy_(pinned, non_blocking=True))
    h2d_pageable = m / _best(lambda: dev.copy_(pageable))
    return {"copy": copy, "h2d_pinned": h2d_pinned, "h2d_pageable": h2d_pageable}


def prompt(vocab: int) -> list[int]:
    """A fixed random prompt of PROMPT_LEN tokens."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist()


class EngineSystem:
    """The engine on one GPU, as `shardlm generate` and `serve` run it: a rank process, the engine's steps
    (runtime/serve_step.py), decode replayed as CUDA graphs (runtime/slot_graphs.py) unless `graphs` is off;
    `rows` copies of the prompt decode together (one batch, as concurrent requests do), row 0's tokens returned."""

    def __init__(self, folder: Path, dtype: torch.dtype, graphs: bool = True, rows: int = 1, ahead: bool = True):
        from shardlm.engine import LocalEngine
        from shardlm.engine.session import plan_run
        from shardlm.plan.plan import KVBudget
        from shardlm.plan.run import RunFlags
        from shardlm.settings import Settings

        flags = RunFlags(dtype=str(dtype).removeprefix("torch."), device="cuda")
        plan, source = plan_run(str(folder), flags, kv=KVBudget(rows, 1024, 512))
        self.rows = rows
        settings = Settings.from_env(cuda_graphs=graphs, cuda_ahead=ahead)
        self.engine = LocalEngine(plan, source, settings=settings, timeout_s=600).start()
        self.kernels = ("engine, " + ("CUDA-graph decode" if graphs else "eager decode") +
                        (", steps run ahead" if graphs and ahead else "") + f", {rows} rows")

    def generate(self, ids: list[int], new: int) -> list[int]:
        from shardlm.runtime.protocol import SamplingParams

        out = self.engine.generate([ids] * self.rows, new, SamplingParams(), ignore_eos=True).token_ids
        self.rows_equal = sum(row == out[0] for row in out)  # rows whose tokens equal row 0's
        return out[0]

    def close(self) -> None:
        self.engine.close()


class Transformers:
    """transformers on cuda:0 (its default attention), greedy generate."""

    def __init__(self, folder: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to("cuda:0").eval()

    @torch.inference_mode()
    def generate(self, ids: list[int], new: int) -> list[int]:
        x = torch.tensor([ids], device="cuda:0")
        out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[0, len(ids):].tolist()

    def close(self) -> None:
        del self.model
        torch.cuda.empty_cache()


ACCEL = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
folder, budget, new, dtype = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[5])
model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="auto",
                                             max_memory={0: budget, "cpu": 200 * 2**30}).eval()
placed = {}
for k, v in model.hf_device_map.items():
    placed[str(v)] = placed.get(str(v), 0) + 1
g = torch.Generator().manual_seed(0)
ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=g).to("cuda:0")
def run(n):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    torch.cuda.synchronize(); return time.perf_counter() - t0, out[0, 40:].tolist()
run(8)
samples = []
for _ in range(int(sys.argv[4])):
    t1, _ = run(1); tn, tokens = run(new)
    samples.append((new - 1) / (tn - t1))
print(json.dumps({"tok_s": samples, "placed": placed, "tokens": tokens,
                  "peak_gpu_bytes": torch.cuda.max_memory_allocated()}))
"""


def decode_rate(system, ids: list[int], new: int) -> tuple[float, list[int]]:
    """Tokens/s over new - 1 decode steps: wall(generate new) - wall(generate 1), times the system's rows."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    system.generate(ids, 1)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    tokens = system.generate(ids, new)
    torch.cuda.synchronize()
    tn = time.perf_counter() - t1
    return getattr(system, "rows", 1) * (new - 1) / (tn - (t1 - t0)), tokens


def weight_bytes(folder: Path) -> int:
    """Bytes of the checkpoint's tensors (its safetensors files)."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


# compiled-cdt: max-autotune-no-cudagraphs plus coordinate-descent tuning of each generated kernel (as gpt-fast);
# compiled-aten-mm: the products left to cuBLAS (an H200 profile put 922 of a step's 1095 us in Inductor's fused
# product reductions, bench/RESULTS.md 2026-11-26 23:00); compiled-triton-mm: only Inductor's own product templates
AUTOTUNE = {"max_autotune": True, "triton.cudagraphs": False}  # the shipped mode, max-autotune-no-cudagraphs
CDT = {**AUTOTUNE, "coordinate_descent_tuning": True}
ATEN_MM = {**AUTOTUNE, "max_autotune_gemm_backends": "ATEN"}
TRITON_MM = {**AUTOTUNE, "max_autotune_gemm_backends": "TRITON"}

VARIANTS = {
    "host-inputs": lambda f, d: Shardlm(f, d, join=False, host_inputs=True),
    "step-by-step": lambda f, d: Shardlm(f, d, ahead=False),
    "unjoined": lambda f, d: Shardlm(f, d, join=False),
    "compiled": lambda f, d: Shardlm(f, d, compile=True),
    "compiled-default-mode": lambda f, d: Shardlm(f, d, compile=True, compile_mode="default"),
    "compiled-cdt": lambda f, d: Shardlm(f, d, compile=True, compile_mode=CDT),
    "compiled-aten-mm": lambda f, d: Shardlm(f, d, compile=True, compile_mode=ATEN_MM),
    "compiled-triton-mm": lambda f, d: Shardlm(f, d, compile=True, compile_mode=TRITON_MM),
    "gemv": lambda f, d: Shardlm(f, d, gemv=True),
    "compiled-gemv": lambda f, d: Shardlm(f, d, compile=True, gemv=True),
    "compiled-gemv-sdpa": lambda f, d: Shardlm(f, d, compile=True, gemv=True, gemv_attention=False),
    "compiled-gemv-nopdl": lambda f, d: Shardlm(f, d, compile=True, gemv=True, pdl=False),
    "compiled-gemv-split": lambda f, d: Shardlm(f, d, compile=True, gemv=True, split=True),
    "compiled-gemv-split-argmax": lambda f, d: Shardlm(f, d, compile=True, gemv=True, split=True, argmax=True),
    "gemv-split-argmax": lambda f, d: Shardlm(f, d, gemv=True, split=True, argmax=True),
    "engine": lambda f, d: EngineSystem(f, d),
    "engine-eager": lambda f, d: EngineSystem(f, d, graphs=False),
    "engine-no-ahead": lambda f, d: EngineSystem(f, d, ahead=False),
    "engine-b8": lambda f, d: EngineSystem(f, d, rows=8),
    "engine-no-ahead-b8": lambda f, d: EngineSystem(f, d, rows=8, ahead=False),
    "engine-eager-b8": lambda f, d: EngineSystem(f, d, graphs=False, rows=8),
}
"""The float graph path's variants (--variants NAME,...): host-inputs, the host building every step's mask,
positions and slot and reading each token before the next replay (the path before 2026-11-26); step-by-step, the
replay advancing its own inputs but the host still reading each token before the next replay; unjoined, q/k/v
and gate/up as separate products; compiled, the step compiled before capture (SHARDLM_CUDA_COMPILE=1: Inductor's
max-autotune-no-cudagraphs mode on a GPU); compiled-default-mode, compiled in Inductor's default mode; compiled-cdt,
the shipped mode plus coordinate-descent tuning (CDT); compiled-aten-mm and compiled-triton-mm, the products on
cuBLAS or on Inductor's templates only; gemv and compiled-gemv, batch-1 decode blocks as shardlm's Triton GEMV
kernels with the norms, gating and residual adds inside and attention as one kernel (SHARDLM_CUDA_GEMV=1 as first
measured), uncompiled and compiled; compiled-gemv-sdpa, the same with the module path's attention; compiled-gemv-nopdl,
each kernel launched after the one before it ends (no programmatic dependent launch); compiled-gemv-split, with
attention split over the keys (kernels/cuda_attention_split.py); compiled-gemv-split-argmax and gemv-split-argmax,
also greedy tokens by kernels/cuda_argmax.py (what SHARDLM_CUDA_GEMV=1 runs now, compiled and
not); engine and engine-eager, the engine's path (`shardlm generate`
and `serve`: a rank process) with and without its CUDA graphs; engine-no-ahead, reading each step's tokens before
launching the next (SHARDLM_CUDA_AHEAD=0); engine-b8, engine-eager-b8 and engine-no-ahead-b8, the same with 8 copies
of the prompt in one batch (tok/s counts every row)."""


def decode_row(label: str, name: str, system, folder: Path, samples: list[float], tokens: dict) -> dict:
    """One system's decode row for the JSON: rates, weight bytes, first tokens equal to transformers' (to its own
    where transformers failed), kernels, replay times (in process) and, for the engine, rows equal to row 0."""
    ref = tokens.get("transformers", tokens[name])
    agree = next((k for k, (a, b) in enumerate(zip(tokens[name], ref)) if a != b), len(ref))
    row = {"model": label, "system": name, "tok_s": samples, "rows": getattr(system, "rows", 1),
           "weight_bytes": system.resident if isinstance(system, Shardlm) else weight_bytes(folder),
           "tokens_equal_to_transformers": agree, "tokens": len(ref), "kernels": getattr(system, "kernels", None),
           "replay_ms": [system.replay_ms() for _ in range(3)] if isinstance(system, Shardlm) else None}
    if isinstance(system, EngineSystem):
        row["rows_equal_to_row_0"] = system.rows_equal
    return row


def run_decode(models: dict, rounds: int, new: int, say, variants: tuple[str, ...] = (),
               baseline: bool = True, profile: bool = False) -> list[dict]:
    """Each model: shardlm (float, int8, int4 where asked; the named VARIANTS of the float graph path) and
    transformers, alternating per round. Without `baseline`, only transformers and the variants."""
    rows = []
    for label, (folder, dtype, quants) in models.items():
        from shardlm.models.args import read_config

        ids = prompt(read_config(folder)["vocab_size"])
        systems = {"transformers": lambda: Transformers(folder, dtype)}
        for q in quants if baseline else []:
            systems[f"shardlm{'' if q is None else ' ' + q}"] = (lambda q=q: Shardlm(folder, dtype, q))
            if q is None:
                systems["shardlm eager"] = lambda: Shardlm(folder, dtype, graphs=False)
        for v in variants:
            systems[f"shardlm {v}"] = lambda v=v: VARIANTS[v](folder, dtype)
        built, errors = {}, {}
        for name, make in systems.items():
            t0 = time.perf_counter()
            try:
                built[name] = make()
                decode_rate(built[name], ids, new)  # warm-up at full length: kernels, cuBLAS handles, compiling
            except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others' numbers
                errors[name] = f"{type(e).__name__}: {e}"[:2000]
                failed = built.pop(name, None)
                if failed is not None:
                    failed.close()
                say(f"  {label} {name} failed: {errors[name][:300]}")
                continue
            kernels = getattr(built[name], "kernels", None)
            say(f"  {label} {name} ready in {time.perf_counter() - t0:.0f} s{f' ({kernels})' if kernels else ''}")
        samples = {name: [] for name in built}
        tokens = {}
        for r in range(rounds):
            order = list(built) if r % 2 == 0 else list(reversed(built))
            for name in order:
                rate, tokens[name] = decode_rate(built[name], ids, new)
                samples[name].append(rate)
            say(f"  {label} round {r + 1}: " + ", ".join(f"{n} {samples[n][-1]:.1f}" for n in built))
        for name, system in built.items():
            rows.append(decode_row(label, name, system, folder, samples[name], tokens))
            if profile and isinstance(system, Shardlm):
                rows[-1]["kernel_profile"] = prof = system.kernel_profile()
                for kind, part in (prof or {}).items():
                    say(f"  {label} {name} {kind}: {part['kernels_per_step']:.0f} kernels, "
                        f"{part['total_us_per_step']:.0f} us of kernels a step; top: " +
                        "; ".join(f"{k['name'][:60]} {k['us_per_step']:.0f} us" for k in part["top"][:6]))
            if rows[-1]["replay_ms"] and rows[-1]["replay_ms"][0] is not None:
                say(f"  {label} {name}: {statistics.median(samples[name]):.1f} tok/s, GPU time of a replay "
                    f"{min(rows[-1]['replay_ms']):.3f} ms")
            system.close()
        rows.extend({"model": label, "system": name, "error": err} for name, err in errors.items())
    return rows


def run_offload(label: str, folder: Path, dtype: torch.dtype, fraction: float, rounds: int, new: int, say) -> dict:
    """`fraction` of the weights on the GPU: shardlm with and without prefetch, Accelerate."""
    elem = torch.empty(0, dtype=dtype).element_size()
    stored = torch.float32 if "135M" in label else torch.bfloat16
    size = weight_bytes(folder) * elem // torch.empty(0, dtype=stored).element_size()  # in `dtype`
    budget = int(size * fraction)
    ids = prompt(json.loads((folder / "config.json").read_text())["vocab_size"])
    out = {"model": label, "dtype": str(dtype).removeprefix("torch."), "fraction": fraction, "budget": budget,
           "weights": size, "systems": {}}
    built = {"shardlm prefetch": Shardlm(folder, dtype, budget=budget, prefetch=True),
             "shardlm no prefetch": Shardlm(folder, dtype, budget=budget, prefetch=False)}
    for s in built.values():
        decode_rate(s, ids, new)  # warm-up at full length
    before = {name: s.stream_stats() for name, s in built.items()}
    rates, tokens = {name: [] for name in built}, {}
    for r in range(rounds):  # interleaved, the order alternating: this host's speed drifts over minutes
        for name in (list(built) if r % 2 == 0 else list(reversed(built))):
            rate, tokens[name] = decode_rate(built[name], ids, new)
            rates[name].append(rate)
    for name, s in built.items():
        b, a = before[name], s.stream_stats()
        uses = (a["prefetch_hits"] + a["prefetch_waits"]) - (b["prefetch_hits"] + b["prefetch_waits"])
        out["systems"][name] = {"tok_s": rates[name], "resident": s.resident, "per_token": s.streamed_per_token,
                                "hit_rate": (a["prefetch_hits"] - b["prefetch_hits"]) / max(1, uses),
                                "wait_s_per_token": (a["wait_s"] - b["wait_s"]) / max(1, rounds * new),
                                "tokens": tokens[name]}
        say(f"  {name}: {statistics.median(rates[name]):.1f} tok/s, resident {s.resident / 2**20:.0f} MiB, "
            f"streams {s.streamed_per_token / 2**20:.0f} MiB/token")
    out["peak_gpu_bytes_both"] = torch.cuda.max_memory_allocated()
    for s in built.values():
        s.close()
    res = subprocess.run([sys.executable, "-c", ACCEL, str(folder), str(budget), str(new), str(min(rounds, 3)),
                          out["dtype"]],
                         capture_output=True, text=True)
    if res.returncode != 0:
        out["systems"]["accelerate"] = {"error": res.stderr[-1500:]}
        say(f"  accelerate failed: {res.stderr[-500:]}")
    else:
        acc = json.loads(res.stdout.strip().splitlines()[-1])
        out["systems"]["accelerate"] = acc
        say(f"  accelerate: {statistics.median(acc['tok_s']):.1f} tok/s, placed {acc['placed']}")
    return out


def decode_choice(opts, small: Path, big: Path) -> tuple[dict, tuple[str, ...]]:
    """The decode runs --models, --no-quantized and --variants ask for: ({label: (folder, dtype, quantizations)},
    variant names); exits with the accepted names on a wrong one."""
    wanted = set(opts.models.split(","))
    if not wanted <= {"smollm2-135m", "llama-3.2-1b"}:
        sys.exit(f"--models {opts.models}: pick from smollm2-135m, llama-3.2-1b")
    models = {}
    if "smollm2-135m" in wanted:
        models["SmolLM2-135M float32"] = (small, torch.float32, [None])
        models["SmolLM2-135M bfloat16"] = (small, torch.bfloat16, [None])
    if "llama-3.2-1b" in wanted:
        models["Llama-3.2-1B bfloat16"] = (big, torch.bfloat16, [None] + ([] if opts.no_quantized else ["int8", "int4"]))
    variants = tuple(v for v in opts.variants.split(",") if v)
    if not set(variants) <= set(VARIANTS):
        sys.exit(f"--variants {opts.variants}: pick from {', '.join(VARIANTS)}")
    return models, variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the measurements to this JSON file")
    ap.add_argument("--report", nargs="+", help="render these JSON files (a decode run, an offload run) into "
                    "bench/RESULTS.md and stop")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--only", choices=("decode", "offload"), help="run one part")
    ap.add_argument("--work", default=None, help="folder for the random checkpoints (default: a temporary one)")
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b",
                    help="comma-separated models to decode: smollm2-135m, llama-3.2-1b")
    ap.add_argument("--variants", default="",
                    help=f"also time these variants of the float graph path, comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--no-baseline", action="store_true", help="time only transformers and --variants")
    ap.add_argument("--no-quantized", action="store_true", help="skip int8 and int4 decode")
    ap.add_argument("--gemv-configs", type=Path,
                    help="launch shapes for the GEMV kernels, as bench/gpu_gemv.py --configs writes them")
    ap.add_argument("--profile", action="store_true",
                    help="after the rounds, profile each shardlm graph system's step kernel by kernel (torch.profiler)")
    opts = ap.parse_args()
    if opts.report:
        from gpu_report import write_report

        write_report([json.loads(Path(f).read_text()) for f in opts.report], opts.report)
        return
    if opts.gemv_configs:
        from shardlm.kernels import cuda_gemv

        for key, shape in json.loads(opts.gemv_configs.read_text()).items():
            cuda_gemv.CONFIGS[tuple(int(v) for v in key.split(","))] = tuple(shape)
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU and a CUDA build of torch; torch.cuda.is_available() is False")

    def say(msg: str) -> None:
        print(msg, flush=True)

    work = Path(opts.work or tempfile.mkdtemp(prefix="shardlm-gpu-"))
    t0 = time.perf_counter()
    small, big = work / "smollm2-135m", work / "llama-3.2-1b"
    if not (small / "config.json").exists():
        write_random_checkpoint(PRESETS["smollm2-135m"], small, dtype=torch.float32)
    if not (big / "config.json").exists():
        write_random_checkpoint(PRESETS["llama-3.2-1b"], big, dtype=torch.bfloat16, max_shard_bytes=2**30)
    say(f"checkpoints ready in {time.perf_counter() - t0:.0f} s")
    import accelerate
    import transformers

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    result = {"when": dt.datetime.now().isoformat(timespec="minutes"), "gpu": torch.cuda.get_device_name(0),
              "nvidia_smi": smi, "torch": torch.__version__, "transformers": transformers.__version__,
              "accelerate": accelerate.__version__, "command": "python bench/gpu.py " + " ".join(sys.argv[1:]),
              "rounds": opts.rounds, "new_tokens": opts.new_tokens}
    result["floors"] = floors()
    say("floors (GB/s): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in result["floors"].items()))
    models, variants = decode_choice(opts, small, big)
    result["decode"] = [] if opts.only == "offload" else run_decode(models, opts.rounds, opts.new_tokens, say,
                                                                    variants, not opts.no_baseline, opts.profile)
    result["offload"] = [] if opts.only == "decode" else [run_offload("SmolLM2-135M", small, torch.float32, 0.3, opts.rounds, min(opts.new_tokens, 64), say),
                         run_offload("Llama-3.2-1B", big, torch.bfloat16, 0.4, opts.rounds, min(opts.new_tokens, 64), say)]
    result["seconds"] = time.perf_counter() - t0
    text = json.dumps(result, indent=1)
    if opts.out:
        Path(opts.out).write_text(text)
    say(f"done in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
