"""The decode products alone (csrc/rows.h through the `gemv` op): the bundled model's seven products of a layer at a
few rows, over 30 layers of distinct weights (as a decode step reads them: from memory) and over one layer's (from
the caches), in one process.

    python bench/decode_products.py [--rows 1,8,16] [--rounds 15]
                                    [--format bfloat16 | int8 | int4 [--sums rank|float|exact]
                                    [--natural]]

Random float32 weights of the bundled model's shapes (q and o 576 x 576, k and v 192 x 576, gate and up 1536 x 576,
down 576 x 1536) and activations, on the machine's cores, with a rank's malloc settings. Per row count: the best of
`--rounds` passes over the 30 layers, as ms, GFLOP/s and GB/s of weights read. It isolates the products of a
batch-16 decode step (what a serving step at 16 streams spends most of its time in) from the rest of the step.
`--format int8` times the same shapes as int8 weights through `gemv_int8` (qrows.h): by default o and down with the
double-summed block terms a rank gives them (`exact`, so tensor-parallel parts add up) and the rest with float lane
sums; `--sums float` or `--sums exact` puts every product on one of the two, to see what the exact sums cost.
`--format int4` times them as int4 weights in groups of 32 through `gemm_int4` (q4tiles.h; the same `--sums`).
`--format bfloat16` times them as bfloat16 weights (bf16rows.h). With PYTHONPATH at another tree's src, the same
table for that tree's kernels.
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


def best_pass(layers: list[list], xs: dict, rounds: int) -> float:
    """Seconds of the fastest pass over `layers` (lists of (in features, product)), each product once."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for products in layers:
            for k, product in products:
                product(xs[k])
        best = min(best, time.perf_counter() - t0)
    return best


def layer_products(ext, g: torch.Generator, fmt: str, sums: str, natural: bool) -> tuple[list, int]:
    """One layer's seven products as (in features, callable on x) and its weight bytes; `natural`: exact int8
    weights keep their codes in natural order (a rank interleaves them, csrc/qexact.h)."""
    from shardlm.quant import quantize_int4, quantize_int8

    products, size = [], 0
    for i, (n, k) in enumerate(SHAPES):
        w = torch.randn(n, k, generator=g) * 0.02
        if fmt in ("float32", "bfloat16"):
            w = w.to(getattr(torch, fmt))
            products.append((k, lambda x, w=w: ext.gemv(x, w)))
            size += w.element_size() * n * k
            continue
        exact = sums == "exact" or (sums == "rank" and i in (3, 6))  # o and down: row-parallel under tp
        if fmt == "int4":
            q4 = quantize_int4(w)
            q4.exact = exact
            products.append((k, lambda x, q=q4: ext.gemm_int4(x, *q.kernel_args(), q.exact)))
            size += q4.packed.numel() + 2 * q4.scales_zeros.numel()
            continue
        qw = quantize_int8(w)
        more = {}
        if exact and not natural:  # as a rank holds them
            qw.exact = True
            qw.interleave()
            more = {"interleaved": True}
        products.append((k, lambda x, q=qw.q, s=qw.scale, e=exact, m=more: ext.gemv_int8(x, q, s, exact=e, **m)))
        size += qw.q.numel() + 4 * n
    return products, size


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--format", choices=("float32", "bfloat16", "int8", "int4"), default="float32")
    ap.add_argument("--sums", choices=("rank", "float", "exact"), default="rank",
                    help="int8, int4: o and down summed as a rank sums them (rank), or every product one way")
    ap.add_argument("--natural", action="store_true",
                    help="int8: exact weights' codes in natural order (a rank interleaves them; a tree before "
                         "csrc/qexact.h has only this)")
    args = ap.parse_args()
    set_malloc(False)
    ext = extension(Settings.from_env().kernel_dir)
    if ext is None:
        raise SystemExit("the compiled kernels could not be built here (a C++ compiler is needed); see the log above")
    g = torch.Generator().manual_seed(0)
    built = [layer_products(ext, g, args.format, args.sums, args.natural) for _ in range(LAYERS)]
    layers, layer_bytes = [p for p, _ in built], built[0][1]
    sums = f", {args.sums} sums" + (", natural codes" if args.natural else "")
    print(f"{torch.get_num_threads()} threads; {LAYERS} layers of {layer_bytes / 2**20:.1f} MiB, {args.format}"
          + (sums if args.format in ("int8", "int4") else ""))
    print("| rows | weights | ms for 30 layers | GFLOP/s | GB/s read |")
    print("|---|---|---|---|---|")
    for b in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(b, k, generator=g) for k in (576, 1536)}
        flop = 2 * b * LAYERS * sum(n * k for n, k in SHAPES)
        for where, ls in (("30 layers (memory)", layers), ("one layer 30 times (caches)", [layers[0]] * LAYERS)):
            s = best_pass(ls, xs, args.rounds)
            print(f"| {b} | {where} | {s * 1e3:.2f} | {flop / s / 1e9:.0f} | {LAYERS * layer_bytes / s / 1e9:.1f} |")


if __name__ == "__main__":
    main()
