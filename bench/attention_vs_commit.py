"""Prefill attention: this tree's kernel against an earlier commit's, both loaded in one process, and torch's SDPA.

    python bench/attention_vs_commit.py --commit 0e6e3c2 [--dtypes bfloat16,float32] [--tokens 512] [--calls 40]

One layer's causal attention of the bundled model's shapes (9 query heads reading 3 KV heads of 64), a prompt of
--tokens positions, random inputs. The two builds and SDPA (torch's CPU flash attention, what transformers'
`model(ids)` calls, with the KV heads repeated for it) are timed a call at a time in turn, the order rotating, so
all three see the same minutes of this VM. The earlier commit's kernels are built and loaded as in
bench/products_vs_commit.py. Prints the median and best ms a call, the ratios, and how far this tree's output is
from the earlier build's and from SDPA in float64 (largest absolute difference over the output's largest value).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
from decode_vs_commit import ROOT, worktree  # noqa: E402  (a sibling script)
from products_vs_commit import built_kernels  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def inputs(tokens: int, dtype: torch.dtype) -> tuple:
    """q (1, 9, s, 64), k and v (1, 3, s, 64) in `dtype`, the KV map and the causal mask (1, 1, s, s)."""
    from shardlm.runtime.step import attention_mask

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, tokens, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    kv_map = torch.arange(HEADS) // (HEADS // KV_HEADS)
    mask = attention_mask(torch.ones(1, tokens, dtype=torch.bool), 0, tokens, None).contiguous()
    return q, k, v, kv_map, mask


def sdpa(q, k, v, kv_map, mask):
    """torch's SDPA on the same inputs (the KV heads repeated for the query heads), causal."""
    return F.scaled_dot_product_attention(q, k.index_select(1, kv_map), v.index_select(1, kv_map), is_causal=True)


def timed(fn, args: tuple) -> float:
    """ms of one call."""
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def compare(builds: dict, dtype: torch.dtype, tokens: int, calls: int) -> str:
    """One table row: each build's and SDPA's median (best) ms, this tree / commit, this tree / SDPA, differences."""
    args = inputs(tokens, dtype)
    fns = {name: ext.prefill_attention for name, ext in builds.items()} | {"sdpa": sdpa}
    names = list(fns)
    got = {n: [] for n in names}
    for c in range(calls):
        for n in names[c % 3:] + names[:c % 3]:
            got[n].append(timed(fns[n], args))
    med = {n: statistics.median(v) for n, v in got.items()}
    mine, theirs = fns[names[0]](*args).double(), fns[names[1]](*args).double()
    exact = sdpa(*(a.double() if a.is_floating_point() else a for a in args))
    scale = exact.abs().max().item()
    cells = " | ".join(f"{med[n]:.3f} ({min(got[n]):.3f})" for n in names)
    return (f"| {str(dtype).replace('torch.', '')} | {cells} | {med[names[0]] / med[names[1]]:.3f} | "
            f"{med[names[0]] / med['sdpa']:.3f} | {(mine - theirs).abs().max().item() / scale:.1e} | "
            f"{(mine - exact).abs().max().item() / scale:.1e} |")


def main() -> None:
    """Build both, time them with SDPA in turn, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", required=True)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--calls", type=int, default=40, help="calls of each, in turn")
    args = ap.parse_args()
    if args.tokens < 1 or args.calls < 1:
        raise SystemExit(f"--tokens {args.tokens} and --calls {args.calls}: each must be 1 or more")
    builds = {"this tree": built_kernels(ROOT), args.commit: built_kernels(worktree(args.commit))}
    print(f"{torch.get_num_threads()} threads; {HEADS} query heads on {KV_HEADS} KV heads of {HEAD_DIM}, causal, "
          f"{args.tokens} tokens; {args.calls} calls each, in turn")
    print(f"| dtype | this tree, ms median (best) | {args.commit} | SDPA | this / {args.commit} | this / SDPA | "
          f"max diff to {args.commit} | max diff to float64 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        print(compare(builds, getattr(torch, name), args.tokens, args.calls), flush=True)


if __name__ == "__main__":
    main()
