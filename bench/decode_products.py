"""The decode products alone (csrc/rows.h through the `gemv` op): the bundled model's seven products of a layer at a
few rows, over 30 layers of distinct weights (as a decode step reads them: from memory) and over one layer's (from
the caches), in one process.

    python bench/decode_products.py [--rows 1,8,16] [--rounds 15]

Random float32 weights of the bundled model's shapes (q and o 576 x 576, k and v 192 x 576, gate and up 1536 x 576,
down 576 x 1536) and activations, on the machine's cores, with a rank's malloc settings. Per row count: the best of
`--rounds` passes over the 30 layers, as ms, GFLOP/s and GB/s of weights read. It isolates the products of a
batch-16 decode step (what a serving step at 16 streams spends most of its time in) from the rest of the step.
"""

from __future__ import annotations

import argparse
import time

import torch

from shardlm.kernels.build import extension
from shardlm.runtime.worker import set_malloc
from shardlm.settings import Settings

SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
"""(out, in) of one layer's products: q, k, v, o, gate, up, down."""
LAYERS = 30


def best_pass(ext, layers: list[list[torch.Tensor]], xs: dict, rounds: int) -> float:
    """Seconds of the fastest pass over `layers`, each product once."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for ws in layers:
            for w in ws:
                ext.gemv(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    set_malloc(False)
    ext = extension(Settings.from_env().kernel_dir)
    if ext is None:
        raise SystemExit("the compiled kernels could not be built here (a C++ compiler is needed); see the log above")
    g = torch.Generator().manual_seed(0)
    layers = [[torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    layer_bytes = sum(4 * n * k for n, k in SHAPES)
    print(f"{torch.get_num_threads()} threads; {LAYERS} layers of {layer_bytes / 2**20:.1f} MiB")
    print("| rows | weights | ms for 30 layers | GFLOP/s | GB/s read |")
    print("|---|---|---|---|---|")
    for b in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(b, k, generator=g) for k in (576, 1536)}
        flop = 2 * b * LAYERS * sum(n * k for n, k in SHAPES)
        for where, ls in (("30 layers (memory)", layers), ("one layer 30 times (caches)", [layers[0]] * LAYERS)):
            s = best_pass(ext, ls, xs, args.rounds)
            print(f"| {b} | {where} | {s * 1e3:.2f} | {flop / s / 1e9:.0f} | {LAYERS * layer_bytes / s / 1e9:.1f} |")


if __name__ == "__main__":
    main()
