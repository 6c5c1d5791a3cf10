"""Batch-1 decode products on a GPU: shardlm's Triton GEMV (kernels/cuda_gemv.py) against cuBLAS and Inductor.

Llama-3.2-1B's five product shapes in bfloat16, each as its decode block uses it (q/k/v and gate/up read a
normalized input, o adds the residual, down reads silu(gate) * up and adds the residual, the head reads the final
norm). Each system runs a shape's product over enough copies of the weight to leave L2 (at least 400 MB), back to
back in one CUDA graph, as a step runs one layer after another; the replays are timed with CUDA events and give the
time of one product and its read bandwidth. Every launch shape of the GEMV in a small grid is checked against the
module path's arithmetic (float64 product) and timed; the fastest per weight shape go to --configs, which
bench/gpu.py --gemv-configs loads.

    python bench/gpu_gemv.py --out gpu-out/gemv.json --configs gpu-out/gemv_configs.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shardlm.kernels import cuda_gemv  # noqa: E402

SHAPES = {  # name: (N, K, norm, silu, residual) for Llama-3.2-1B
    "qkv": (3072, 2048, True, False, False),
    "o": (2048, 2048, False, False, True),
    "gate_up": (16384, 2048, True, False, False),
    "down": (2048, 8192, False, True, True),
    "head": (128256, 2048, True, False, False),
}
GRID = [(bn, bk, w) for bn in (1, 2, 4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8)
        if bn * bk // (w * 32) <= 128]


def torch_fused(x, w, nw, r, eps: float, silu: bool):
    """The block's arithmetic around one product in torch ops (what Inductor compiles)."""
    if silu:
        gate, up = x.chunk(2)
        x = F.silu(gate) * up
    if nw is not None:
        x = nw * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    y = F.linear(x[None], w)[0]
    return y if r is None else r + y


def graph_us(calls, copies: int, replays: int = 20, rounds: int = 5) -> float:
    """Median us of one call: `calls(i)` for every copy i back to back in one graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(copies):
            calls(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            calls(i)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (replays * copies))
    return statistics.median(times)


def error_ulps(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative norm error, largest difference in units of the reference's last place)."""
    got, ref = got.double(), ref.double()
    rel = ((got - ref).norm() / ref.norm()).item()
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)  # bfloat16: 8 significant bits
    return rel, ((got - ref).abs() / ulp).max().item()


def run_shape(name: str, spec, dtype: torch.dtype, compile_inductor: bool) -> dict:
    """Every system on one product shape: times, bandwidth, errors."""
    n, k, norm, silu, res = spec
    nbytes = n * k * torch.finfo(dtype).bits // 8
    copies = max(2, math.ceil(400e6 / nbytes))
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / math.sqrt(k) for _ in range(copies)]
    x = torch.randn(2 * k if silu else k, device="cuda", dtype=dtype, generator=g)
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(dtype) if norm else None
    r = torch.randn(n, device="cuda", dtype=dtype, generator=g) if res else None
    eps = 1e-5
    ref = cuda_gemv.reference(x, ws[0], nw, r, eps, silu)
    rows = []

    def add(system, fn, out, replayed=None):
        if replayed is not None:
            replayed.fill_(float("nan"))
        us = graph_us(fn, copies)
        rel, ulps = error_ulps(out, ref)
        if replayed is not None:  # what the graph's chained (PDL) launches left for the first copy: also ref
            rel, ulps = max(rel, error_ulps(replayed, ref)[0]), max(ulps, error_ulps(replayed, ref)[1])
        rows.append({"system": system, "us": us, "GB_s": nbytes / us / 1e3, "rel_err": rel, "max_ulps": ulps})

    add("cublas (torch ops)", lambda i: torch_fused(x, ws[i], nw, r, eps, silu), torch_fused(x, ws[0], nw, r, eps, silu))
    if compile_inductor:
        t0 = time.perf_counter()
        fused = torch.compile(torch_fused, dynamic=False, mode="max-autotune-no-cudagraphs")
        out = fused(x, ws[0], nw, r, eps, silu)
        compile_s = time.perf_counter() - t0
        add("inductor (max-autotune-no-cudagraphs)", lambda i: fused(x, ws[i], nw, r, eps, silu), out)
        rows[-1]["compile_s"] = compile_s
    outs = [torch.empty(n, device="cuda", dtype=dtype) for _ in range(copies)]
    for shape in GRID:
        poisoned = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
        out = cuda_gemv.launch(x, ws[0], nw, r, eps, silu, out=poisoned, shape=shape, pdl=False)
        add(f"gemv {shape[0]}x{shape[1]} w{shape[2]}", lambda i, shape=shape: cuda_gemv.launch(
            x, ws[i], nw, r, eps, silu, out=outs[i], shape=shape, pdl=False), out, outs[0])
    ranked = sorted((row for row in rows if row["system"].startswith("gemv")), key=lambda row: row["us"])
    for row in ranked[:3]:  # the fastest launch shapes again, each launch overlapping the one before (PDL)
        bn, bk, w = row["system"].split()[1].split("x") + [row["system"].split()[2][1:]]
        shape = (int(bn), int(bk), int(w))
        poisoned = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
        out = cuda_gemv.launch(x, ws[0], nw, r, eps, silu, out=poisoned, shape=shape, pdl=True)
        add(row["system"] + " pdl", lambda i, shape=shape: cuda_gemv.launch(
            x, ws[i], nw, r, eps, silu, out=outs[i], shape=shape, pdl=True), out, outs[0])
    default = cuda_gemv.config(n, k)
    return {"shape": name, "n": n, "k": k, "bytes": nbytes, "copies": copies, "default": default, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu-out/gemv.json"))
    ap.add_argument("--configs", type=Path, help="write the fastest launch shape per weight shape here")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-inductor", action="store_true", help="skip the compiled peer (compiling takes a while)")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_gemv: needs a CUDA GPU")
    copy = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(copy)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(copy)
    torch.cuda.synchronize()
    copy_gbs = 2 * 10 * 2**30 / (time.perf_counter() - t0) / 1e9
    del copy, dst
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s (read + write)", flush=True)
    results, best = [], {}
    for name in opts.shapes.split(","):
        t0 = time.perf_counter()
        res = run_shape(name, SHAPES[name], torch.bfloat16, not opts.no_inductor)
        results.append(res)
        good = [r for r in res["rows"] if r["system"].startswith("gemv") and r["max_ulps"] <= 2]
        fastest = min(good, key=lambda r: r["us"]) if good else None
        for r in sorted(res["rows"], key=lambda r: r["us"])[:8] + [r for r in res["rows"] if "gemv" not in r["system"]]:
            print(f"{name:8s} {r['system']:40s} {r['us']:9.2f} us  {r.get('GB_s', 0):7.0f} GB/s  "
                  f"err {r.get('rel_err', 0):.1e} ulps {r.get('max_ulps', 0):.0f}", flush=True)
        bad = [r["system"] for r in res["rows"] if r["system"].startswith("gemv") and r["max_ulps"] > 2]
        print(f"{name}: {time.perf_counter() - t0:.0f} s; over 2 ulps: {bad or 'none'}", flush=True)
        if fastest:
            bn, bk, w = fastest["system"].split()[1].split("x") + [fastest["system"].split()[2][1:]]
            best[f"{res['n']},{res['k']}"] = [int(bn), int(bk), int(w)]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_GB_s": copy_gbs,
                                    "torch": torch.__version__, "results": results, "best": best}, indent=1))
    if opts.configs:
        opts.configs.write_text(json.dumps(best))
    print("best:", best)


if __name__ == "__main__":
    main()
