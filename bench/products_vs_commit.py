"""The decode products of this tree's kernels against an earlier commit's, both loaded in one process.

    python bench/products_vs_commit.py --commit d92a995 [--format float32|bfloat16|int8|int4 [--exact]]
                                       [--rows 1,4,16] [--passes 16] [--caches]

The bundled model's seven products of a layer (bench/decode_products.py's shapes, random weights) over 30 layers of
distinct weights (from memory; `--caches`: one layer's weights 30 times), timed a pass at a time with the two
builds alternating pass by pass, so that both see the same minutes of this VM's read bandwidth (it swings by 2x
within minutes, which separate processes, as in bench/step_vs_commit.py, only average out over many rounds). The
earlier commit is checked out as a git worktree (/tmp/shardlm-COMMIT, as bench/decode_vs_commit.py does) and its
kernels built by a child process with that tree on PYTHONPATH; this process then loads both builds (each build is
its own module). int4 weights are packed by each tree's own shardlm/quant.py (their layouts may differ), from the
same float weights; int8 ones are shared, their codes paired for a tree whose quant.py pairs them (csrc/qpairs.h) as
a rank holds them (the float-summed products; `--exact`: interleaved in both). Prints the median and best ms of a
pass over the 30 layers per build and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.machinery
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
from decode_products import LAYERS, SHAPES  # noqa: E402  (a sibling script)
from decode_vs_commit import ROOT, worktree  # noqa: E402
BUILD = ("from shardlm.kernels.build import extension; from shardlm.settings import Settings; "
         "print(extension(Settings.from_env().kernel_dir).__file__)")


def built_kernels(tree: Path):
    """The compiled kernels of `tree` (built in a child with the tree's src first on the path), loaded here."""
    out = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(tree / "src")})
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(f"the kernels of {tree} did not build:\n{out.stderr[-2000:]}")
    path = out.stdout.strip().splitlines()[-1]
    name = Path(path).name.split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path,
                                                  loader=importlib.machinery.ExtensionFileLoader(name, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree_quant(tree: Path):
    """`tree`'s shardlm/quant.py loaded as a module of its own (its imports resolve to this tree's modules)."""
    name = f"quant_of_{abs(hash(str(tree)))}"
    spec = importlib.util.spec_from_file_location(name, tree / "src" / "shardlm" / "quant.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def layer_weights(g: torch.Generator, fmt: str, quants: list) -> list:
    """One layer's seven weights as (in features, [weight in `fmt` for each build]): int4 packed by each build's
    quant module (`quants`), the other formats shared."""
    from shardlm.quant import quantize_int8

    out = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.02
        if fmt == "int4":
            out.append((k, [q.quantize_int4(w) for q in quants]))
        elif fmt == "int8":
            one = quantize_int8(w)
            out.append((k, [paired_copy(one) if hasattr(q, "pair_columns") else one for q in quants]))
        else:
            one = quantize_int8(w) if fmt == "int8" else w.to(getattr(torch, fmt))
            out.append((k, [one] * len(quants)))
    return out


def paired_copy(w):
    """An int8 weight's copy with its codes in the paired order (this tree's shardlm.quant)."""
    from shardlm.quant import pair_columns

    return dataclasses.replace(w, q=pair_columns(w.q), paired=True)


def one_pass(ext, layers: list, xs: dict, fmt: str, exact: bool = False, build: int = 0) -> float:
    """ms of one pass over `layers` with `ext`'s products (int8: float-summed rows, gemv_int8's default; `exact`:
    every product summed exact on interleaved codes, as a rank sums its o and down projections; int4: the float
    sums, or `exact` the double ones); `build`: which build's weights each entry takes."""
    t0 = time.perf_counter()
    for layer in layers:
        for k, ws in layer:
            w = ws[build]
            if fmt == "int4":
                ext.gemm_int4(xs[k], *w.kernel_args(), exact, False)
            elif fmt == "int8" and exact:
                ext.gemv_int8(xs[k], w.q, w.scale, True, False, True)
            elif fmt == "int8" and getattr(w, "paired", False):
                ext.gemv_int8(xs[k], w.q, w.scale, paired=True)
            elif fmt == "int8":
                ext.gemv_int8(xs[k], w.q, w.scale)
            else:
                ext.gemv(xs[k], w)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    """Build both, time them alternating, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", required=True)
    ap.add_argument("--format", choices=("float32", "bfloat16", "int8", "int4"), default="bfloat16")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--passes", type=int, default=16, help="passes per build and row count")
    ap.add_argument("--caches", action="store_true", help="one layer's weights 30 times instead of 30 layers")
    ap.add_argument("--exact", action="store_true",
                    help="int8: every product summed exact on interleaved codes (both trees need csrc/qexact.h); "
                         "int4: every product summed in double")
    args = ap.parse_args()
    trees = {"this tree": ROOT, args.commit: worktree(args.commit)}
    builds = {name: built_kernels(tree) for name, tree in trees.items()}
    quants = [tree_quant(tree) for tree in trees.values()] if args.format in ("int4", "int8") else [None, None]
    g = torch.Generator().manual_seed(0)
    layers = [layer_weights(g, args.format, quants) for _ in range(1 if args.caches else LAYERS)]
    if args.exact and args.format == "int8":
        from shardlm.quant import interleave_columns

        for i, layer in enumerate(layers):
            layers[i] = [(k, [dataclasses.replace(ws[-1], q=interleave_columns(ws[-1].q), interleaved=True)] * 2)
                         for k, ws in layer]
    layers = layers * (LAYERS // len(layers))
    where = "one layer's weights 30 times (caches)" if args.caches else "30 layers (memory)"
    print(f"{torch.get_num_threads()} threads; {args.format}{', exact sums' if args.exact else ''}; {where}; "
          f"{args.passes} passes a build, alternating")
    print(f"| rows | this tree, ms median (best) | {args.commit}, ms median (best) | this / {args.commit} |")
    print("|---|---|---|---|")
    names = list(builds)
    for b in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(b, k, generator=g) for k in (576, 1536)}
        got = {n: [] for n in names}
        for p in range(args.passes):
            for name in names if p % 2 else names[::-1]:
                got[name].append(one_pass(builds[name], layers, xs, args.format, args.exact, names.index(name)))
        med = {n: statistics.median(v) for n, v in got.items()}
        cells = " | ".join(f"{med[n]:.2f} ({min(got[n]):.2f})" for n in names)
        print(f"| {b} | {cells} | {med[names[0]] / med[names[1]]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
