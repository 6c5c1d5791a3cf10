"""Float32 prefill products of a few rows, in place (csrc/fewrows.h) against through panels (csrc/qgemm.h), in one
process: where the crossover `FEW_ROWS` belongs.

    python bench/few_rows.py [--rows 8,16,17,24,32,48,64] [--rounds 6] [--arch native]

The bundled model's seven products of a layer over 30 layers of distinct random weights (from memory, as a prefill
pass reads them), at each row count through both kernels (the `few_rows` argument of `prefill_float` forces one),
alternating within each round; the median ms of a pass over the 30 layers, and whether both gave the same bits (they
must: one FMA chain per output over k in order either way). Run it on another tree with
PYTHONPATH=<tree>/src to compare builds; --arch haswell times the AVX2 build (on this CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shardlm.kernels.build import extension
from shardlm.runtime.worker import set_malloc
from shardlm.settings import Settings

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
"""(out, in) of one layer's products: q, k, v, o, gate, up, down."""
LAYERS = 30
PANELS, IN_PLACE = 0, 1 << 20
"""`few_rows` arguments that force the panels or the in-place kernel."""


def one_pass(ext, layers: list[list[torch.Tensor]], xs: list[torch.Tensor], few_rows: int) -> float:
    """Seconds of one pass over `layers`, each product once."""
    t0 = time.perf_counter()
    for weights in layers:
        for x, w in zip(xs, weights):
            ext.prefill_float(x, w, few_rows)
    return time.perf_counter() - t0


def main() -> None:
    """Time both kernels at each row count and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="8,16,17,24,32,48,64")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--arch", default="native", help="the kernels' -march target (haswell: the AVX2 build)")
    args = ap.parse_args()
    set_malloc(False)
    ext = extension(Settings.from_env().kernel_dir, args.arch)
    g = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    print("| rows | in place ms | panels ms | in place / panels | same bits |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k, generator=g) for _, k in SHAPES]
        times: dict[int, list[float]] = {PANELS: [], IN_PLACE: []}
        for r in range(args.rounds):
            for kind in ((PANELS, IN_PLACE) if r % 2 == 0 else (IN_PLACE, PANELS)):
                times[kind].append(one_pass(ext, layers, xs, kind))
        a, b = statistics.median(times[IN_PLACE]), statistics.median(times[PANELS])
        same = all(torch.equal(ext.prefill_float(x, w, PANELS), ext.prefill_float(x, w, IN_PLACE))
                   for x, w in zip(xs, layers[0]))
        print(f"| {rows} | {a * 1e3:.1f} | {b * 1e3:.1f} | {a / b:.3f} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
