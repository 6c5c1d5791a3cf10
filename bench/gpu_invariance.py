"""Which GPU kernels make a row's bfloat16 result depend on the rows beside it, and which engine schedules do.

Written after an H200 run in which 8 copies of one prompt in one engine batch decoded different tokens
(bench/RESULTS.md, 2026-11-26). Three parts, one JSON (written after each):

- kernels: row 0 of a bf16 product (Llama-3.2-1B's widths) computed inside batches of M rows and compared bit for
  bit with M = 1; the same for attention (SDPA) of one query over a masked key length (up to 4096 keys, and one
  call twice); each product shape captured in a CUDA graph against eager and its replays against each other;
- engine: Llama-3.2-1B's shapes with random bfloat16 weights, 8 copies of one prompt in one batch of the engine
  (as bench/gpu.py engine-b8), with the engine's defaults, without run-ahead, eager, and with prefill chunks
  sharing passes: each row's first token unlike row 0's and unlike the prompt decoded alone, and the seconds
  8 prompts arriving at once take to their first token (a pass per chunk against shared passes);
- in process: the rank's loop and the engine's driver in one process, every decode replay over the rows in use or
  over all slots (no setting turns that on), each run twice to show a kernel that is not deterministic.

Usage (needs a CUDA GPU): python bench/gpu_invariance.py --out gpu-out/invariance.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]  # tests/: the in-process driver


def _rows_equal_alone(fn, rows: list[int]) -> dict[int, float]:
    """For each M: max |row 0 in a batch of M - row 0 alone| (0.0 means bit-identical)."""
    alone = fn(1)
    return {m: float((fn(m)[0].float() - alone[0].float()).abs().max()) for m in rows}


def kernels(dim: int = 2048, hidden: int = 8192, rows=(1, 2, 3, 4, 8, 16, 40, 120, 320)) -> dict:
    """Row 0 of bf16 products and attention in batches of M rows against M = 1."""
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    w_up = torch.randn(hidden, dim, device=dev, dtype=bf, generator=g) * 0.02
    w_down = torch.randn(dim, hidden, device=dev, dtype=bf, generator=g) * 0.02
    x0 = torch.randn(1, dim, device=dev, dtype=bf, generator=g)
    xh0 = torch.randn(1, hidden, device=dev, dtype=bf, generator=g)
    fill = torch.randn(max(rows), hidden, device=dev, dtype=bf, generator=g)

    def up(m):
        return F.linear(torch.cat([x0, fill[:m - 1, :dim]]), w_up)

    def down(m):
        return F.linear(torch.cat([xh0, fill[:m - 1]]), w_down)

    out = {"up 2048->8192": _rows_equal_alone(up, list(rows)), "down 8192->2048": _rows_equal_alone(down, list(rows))}
    for name, n in (("q/k/v joined 2048->3072", 3072), ("gate/up joined 2048->16384", 16384), ("head 2048->128256",
                                                                                              128256)):
        w = torch.randn(n, dim, device=dev, dtype=bf, generator=g) * 0.02
        out[name] = _rows_equal_alone(lambda m, w=w: F.linear(torch.cat([x0, fill[:m - 1, :dim]]), w), list(rows))
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    out["down, no reduced-precision reduction"] = _rows_equal_alone(down, list(rows))
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag
    out["attention"] = attention()
    out["in a CUDA graph"] = graph_products(dim, hidden)
    return out


def graph_products(dim: int, hidden: int, rows: int = 8) -> dict:
    """Each product shape at `rows` rows captured in a CUDA graph: max |graph - eager|, max over 5 replays of
    |replay - first replay|, and row 0 against the 1-row eager product (all 0.0: graphs change nothing)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    out = {}
    for name, (n, k) in {"down": (dim, hidden), "gate/up joined": (2 * hidden, dim), "q/k/v joined": (3072, dim),
                         "head": (128256, dim)}.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
        eager = F.linear(x, w)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capturing stream, as torch's graph docs ask
            for _ in range(3):
                F.linear(x, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = F.linear(x, w)
        replays = []
        for _ in range(5):
            graph.replay()
            torch.cuda.synchronize()
            replays.append(y.clone().float())
        out[name] = {"graph vs eager": float((replays[0] - eager.float()).abs().max()),
                     "replays": max(float((r - replays[0]).abs().max()) for r in replays),
                     "row 0 vs 1 row": float((replays[0][0] - F.linear(x[:1], w)[0].float()).abs().max())}
    return out


def attention(heads: int = 32, kv_heads: int = 8, hd: int = 64, real: int = 40) -> dict:
    """One query row over `real` keys, in batches of b rows, keys padded (masked) to t: diff vs b = 1, t = real."""
    g = torch.Generator(device="cuda").manual_seed(1)
    dev, bf = "cuda", torch.bfloat16
    q0 = torch.randn(1, heads, 1, hd, device=dev, dtype=bf, generator=g)
    k0 = torch.randn(1, kv_heads, 4096, hd, device=dev, dtype=bf, generator=g)
    v0 = torch.randn(1, kv_heads, 4096, hd, device=dev, dtype=bf, generator=g)

    def run(b, t):
        q = torch.cat([q0, torch.randn(b - 1, heads, 1, hd, device=dev, dtype=bf, generator=g)])
        k = torch.cat([k0[:, :, :t], torch.randn(b - 1, kv_heads, t, hd, device=dev, dtype=bf, generator=g)])
        v = torch.cat([v0[:, :, :t], torch.randn(b - 1, kv_heads, t, hd, device=dev, dtype=bf, generator=g)])
        mask = (torch.arange(t, device=dev) < real)[None, None, None, :].expand(b, 1, 1, t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    alone = run(1, real)
    # the engine's CUDA graphs attend over the whole preallocated cache (max_seq_len keys, masked), where a kernel
    # may split the keys by how many blocks the batch leaves it: hence the long key lengths
    out = {f"b{b} t{t}": float((run(b, t)[0].float() - alone[0].float()).abs().max())
           for b in (1, 8) for t in (real, 64, 128, 256, 1024, 4096)}
    g.manual_seed(2)
    first = run(8, 1024)
    g.manual_seed(2)
    out["b8 t1024 twice"] = float((run(8, 1024).float() - first.float()).abs().max())  # not deterministic if > 0
    return out


def engine(folder: Path) -> dict:
    """8 copies of one 40-token prompt decode 128 tokens together (as bench/gpu.py engine-b8 does): each row's first
    token unlike row 0's and unlike the prompt decoded alone, under each engine setting."""
    from shardlm.engine import LocalEngine
    from shardlm.models.args import read_config
    from shardlm.plan.plan import KVBudget
    from shardlm.engine.session import plan_run
    from shardlm.plan.run import RunFlags
    from shardlm.runtime.protocol import SamplingParams
    from shardlm.settings import Settings

    vocab = read_config(folder)["vocab_size"]
    prompt = torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    plan, source = plan_run(str(folder), RunFlags(device="cuda", dtype="bfloat16"), kv=KVBudget(8, 1024, 512))
    out = {}
    for name, env in (("default", {}), ("no run-ahead", dict(cuda_ahead=False)), ("eager", dict(cuda_graphs=False)),
                      ("shared prefill passes", dict(batch_invariant=False))):
        with LocalEngine(plan, source, settings=Settings.from_env({}, **env), timeout_s=300) as eng:
            alone = eng.generate([prompt], 128, SamplingParams(), ignore_eos=True).token_ids[0]
            rows = eng.generate([prompt] * 8, 128, SamplingParams(), ignore_eos=True).token_ids
            burst = []  # 8 prompts at once, one token each: what a pass per prompt chunk costs the first tokens
            for _ in range(3):
                t0 = time.perf_counter()
                eng.generate([prompt] * 8, 1, SamplingParams(), ignore_eos=True)
                burst.append(round(time.perf_counter() - t0, 4))
        out[name] = {"vs alone": [_first_diff(r, alone) for r in rows],
                     "vs row 0": [_first_diff(r, rows[0]) for r in rows], "burst of 8 prompts, s": burst}
        print(name, json.dumps(out[name]), flush=True)
    return out


def in_process(folder: Path, device: str = "cuda:0", new: int = 128) -> dict:
    """The rank's loop (`serve_steps`, run-ahead included) and the engine's pipelined driver in one process, so that a
    knob without a setting can be turned: every decode replay over all slots. One prompt alone, then 8 copies, the
    first alone in step 0 and the rest arriving over steps 1-3; each variant twice (a run unlike the one before it
    is a kernel that is not deterministic)."""
    from shardlm.engine.session import plan_run
    from shardlm.parallel.context import ParallelContext
    from shardlm.plan.plan import KVBudget
    from shardlm.plan.run import RunFlags
    from shardlm.runtime import slot_graphs
    from shardlm.runtime.build import build_rank_model
    from shardlm.runtime.serve_step import SlotRunner
    from shardlm.settings import Settings

    dev = "cuda" if device.startswith("cuda") else "cpu"
    plan, source = plan_run(str(folder), RunFlags(device=dev, dtype="bfloat16"), kv=KVBudget(8, 1024, 512))
    rank = build_rank_model(plan.rank_spec(0), source, ParallelContext(), Settings.from_env({}), device, "mmap")
    vocab = source.args.vocab_size
    prompt = torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    arrivals = [0] + [1 + i // 3 for i in range(7)]
    shape = slot_graphs.SlotGraphs.shape
    out = {}
    for name, all_rows in (("rows in use", False), ("all slots", True)):
        slot_graphs.SlotGraphs.shape = (lambda self, s, p: (self.cache.slots, shape(self, s, p)[1])) if all_rows \
            else shape
        try:
            runs = [_drive(SlotRunner(rank, ParallelContext()), prompt, when, new)
                    for when in ([0], arrivals, arrivals)]
        finally:
            slot_graphs.SlotGraphs.shape = shape
        alone, rows, again = runs[0][0], runs[1], runs[2]
        out[name] = {"vs alone": [_first_diff(r, alone) for r in rows],
                     "second run vs first": [_first_diff(a, b) for a, b in zip(again, rows)]}
        print("in process,", name, json.dumps(out[name]), flush=True)
    return out


def _drive(runner, prompt: list[int], arrivals: list[int], new: int) -> list[list[int]]:
    """Greedy requests of `prompt`, request i added at turn arrivals[i] of the engine's pipelined driver
    (tests/pipelined_driver.py, anchored chunks) against `serve_steps` in a thread; their tokens."""
    from pipelined_driver import drive
    from shardlm.engine.requests import GenerationParams, Request
    from shardlm.engine.scheduler import Scheduler

    kv = runner.rank.spec.kv
    sched = Scheduler(kv.max_batch, kv.max_seq_len, kv.prefill_chunk, (), anchored=True)
    reqs = [Request(list(prompt), GenerationParams(max_tokens=new, temperature=0, ignore_eos=True)) for _ in arrivals]
    at: dict[int, list] = {}
    for r, when in zip(reqs, arrivals):
        at.setdefault(when, []).append(r)
    done = drive(runner, sched, at, turns=20 * new + max(arrivals) + 10, wait_s=60)
    short = [len(r.output_ids) for r in reqs if len(r.output_ids) != new]
    if short or not done:
        raise RuntimeError(f"requests ended with {short} tokens of {new}, or the rank's loop did not stop")
    return [r.output_ids for r in reqs]


def _first_diff(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix), else None."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if at is None and len(a) != len(b) else at


def main() -> None:
    """Run the three parts, writing the JSON after each (a part that fails or runs out of time keeps the others)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-out/invariance.json")
    a = ap.parse_args()
    from shardlm.models.presets import PRESETS
    from shardlm.models.random import write_random_checkpoint

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_random_checkpoint(PRESETS["llama-3.2-1b"], Path(tmp) / "m", dtype=torch.bfloat16)
        for part, run in (("kernels", kernels), ("engine", lambda: engine(folder)),
                          ("in process", lambda: in_process(folder))):
            try:
                result[part] = run()
                print(part, json.dumps(result[part]), flush=True)
            except Exception as e:  # noqa: BLE001 - keep what the other parts measured, say what failed
                result[part] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{part} failed: {type(e).__name__}: {e}", flush=True)
            out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
