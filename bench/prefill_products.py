"""The prefill products alone: float32 panels (csrc/qgemm.h) against int8 and int4 integer panels (csrc/qpanel.h),
plain and Exact, in one process.

    python bench/prefill_products.py [--rows 512] [--rounds 7] [--calls 10] [--arch haswell]

The bundled model's shapes (o: 576 x 576, down: 576 x 1536, gate and up together: 3072 x 576) with random weights
and activations, on the machine's cores; torch's float32 `F.linear` (MKL or oneDNN, what transformers' prefill runs)
on the same inputs is the peer. Exact is how quantized o and down projections run at every tensor-parallel
degree (each block of 32 columns one term, the terms added in double, so a row-parallel split adds up to the whole
bit for bit); plain is one float32 chain per output. Every case runs once per round, cases in a fixed
order, rounds repeated; the table gives the median ms of a call over rounds and the ratio to float32. The process
takes a rank's malloc settings first (where the tree has them). It isolates what an end-to-end prefill on this VM
cannot resolve (a few percent). `--arch haswell` times the kernels built for AVX2 CPUs (no AVX-512) on this one,
built into a scratch folder.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shardlm.kernels.build import extension
from shardlm.quant import quantize_int4, quantize_int8
from shardlm.settings import Settings

SHAPES = {"o": (576, 576), "down": (576, 1536), "gate+up": (3072, 576)}
"""(out, in) of the bundled model's products."""


def cases(ext, rows: int) -> dict:
    """Name -> a call of one product on fixed inputs."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (n, k) in SHAPES.items():
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) * 0.02
        q8, q4 = quantize_int8(w), quantize_int4(w)
        out[(name, "float32", "plain")] = lambda x=x, w=w: ext.prefill_float(x, w, 16)
        out[(name, "float32", "torch F.linear")] = lambda x=x, w=w: torch.nn.functional.linear(x, w)  # the peer
        for exact in (False, True):
            kind = "exact" if exact else "plain"
            out[(name, "int8", kind)] = lambda x=x, q=q8, e=exact: ext.prefill_int8(x, q.q, q.scale, e, False)
            out[(name, "int4", kind)] = lambda x=x, q=q4, e=exact: ext.prefill_int4(x, *q.kernel_args(), e, False)
    return out


def main() -> None:
    """Parse the flags, build or load the kernels, time them."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512, help="activation rows (prompt tokens) a call")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="calls timed together in a sample")
    ap.add_argument("--arch", default="native", help="the kernels' -march: native (this CPU's) or haswell (AVX2)")
    args = ap.parse_args()
    from shardlm.runtime import worker

    if hasattr(worker, "set_malloc"):  # as a rank does: the products' outputs and panels reuse heap pages
        worker.set_malloc(False)
    with tempfile.TemporaryDirectory(prefix=f"shardlm-{args.arch}-") as scratch:  # a build for an older CPU
        ext = extension(Settings().kernel_dir) if args.arch == "native" else extension(Path(scratch), arch=args.arch)
        run(ext, args)


def run(ext, args) -> None:
    """Time every case of the built kernels `ext` and print the table."""
    if ext is None:
        raise SystemExit("the compiled kernels did not build here (see the log); nothing to time")
    calls = cases(ext, args.rows)
    got: dict = {c: [] for c in calls}
    for _ in range(args.rounds):
        for case, call in calls.items():
            call()  # warm: the panels' buffers and the caches
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            got[case].append((time.perf_counter() - t0) / args.calls * 1e3)
    print(f"kernels: {args.arch} ({ext.int8_units()}); {args.rows} rows, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} rounds of {args.calls} calls\n")
    print("| product | weights | sums | ms a call | / float32 |\n|---|---|---|---|---|")
    for (name, dtype, kind), ms in got.items():
        base = statistics.median(got[(name, "float32", "plain")])
        print(f"| {name} | {dtype} | {kind} | {statistics.median(ms):.3f} | {statistics.median(ms) / base:.2f} |")


if __name__ == "__main__":
    main()
