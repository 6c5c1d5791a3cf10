"""Decode attention alone: a KV head's query heads folded into query positions against SDPA's GQA path and against
K/V gathered per query head, in one process.

    python bench/decode_attention.py [--device cpu|cuda] [--dtype bfloat16] [--rows 1,8,16] [--keys 256]
                                     [--shape llama-3.2-1b] [--rounds 5] [--calls 50] [--deterministic]

One layer's decode attention (one query position a row, a mask per row hiding the keys past its position) at the
given model's head counts, random inputs. Every case runs once per round, cases in a fixed order; the table gives the
median microseconds of a call and, per method, whether it keeps a row's bits: row 0 of the batch against row 0 alone
and the same call twice. On CUDA, `--deterministic` first turns cuDNN's SDPA off as serving ranks do
(runtime/slot_graphs.py deterministic_attention), and the table says whether the memory-efficient kernel takes each
call (an SDPA call restricted to it). Method "folded" is models/llama.py `grouped_attention`'s decode path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardlm.models.llama import grouped_attention
from shardlm.runtime.slot_graphs import deterministic_attention

SHAPES = {"llama-3.2-1b": (32, 8, 64), "smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128)}
"""(query heads, KV heads, head dim)."""


def methods(kv_map: torch.Tensor) -> dict:
    """Name -> attention(q, k, v, mask) -> (b, hq, 1, hd)."""
    return {
        "folded": lambda q, k, v, m: grouped_attention(q, k, v, kv_map, m, True),
        "sdpa gqa": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
        "gathered": lambda q, k, v, m: grouped_attention(q, k, v, kv_map, m, False),
    }


def inputs(rows: int, shape: tuple, keys: int, dtype, device) -> tuple:
    """q (rows, hq, 1, hd), k/v (rows, hkv, keys, hd), mask (rows, 1, 1, keys): row j sees keys <= its position."""
    hq, hkv, hd = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, hq, 1, hd, generator=g).to(device, dtype)
    k = torch.randn(rows, hkv, keys, hd, generator=g).to(device, dtype)
    v = torch.randn(rows, hkv, keys, hd, generator=g).to(device, dtype)
    positions = torch.randint(keys // 2, keys, (rows,), generator=g)
    mask = (torch.arange(keys)[None, :] <= positions[:, None])[:, None, None, :].to(device)
    return q, k, v, mask


def timed(call, device, calls: int) -> float:
    """Microseconds of one call, averaged over `calls`."""
    call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def efficient_takes(method, args) -> bool:
    """Whether SDPA's memory-efficient kernel alone runs this call."""
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            method(*args)
        return True
    except RuntimeError:
        return False


def run(args) -> None:
    """Time every method at every row count; print the table."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.deterministic and device.type == "cuda":
        deterministic_attention()
    shape = SHAPES[args.shape]
    kv_map = torch.tensor([h // (shape[0] // shape[1]) for h in range(shape[0])], device=device)
    named = methods(kv_map)
    batches = {rows: inputs(rows, shape, args.keys, dtype, device) for rows in args.rows}
    times = {(name, rows): [] for name in named for rows in args.rows}
    for _ in range(args.rounds):
        for rows, batch in batches.items():
            for name, method in named.items():
                times[(name, rows)].append(timed(lambda: method(*batch), device, args.calls))
    reference = named["gathered"](*batches[max(args.rows)]).float()
    print(f"{args.shape} {args.dtype} on {device}, {args.keys} keys; median us a call over {args.rounds} rounds")
    print("| method | " + " | ".join(f"{r} rows" for r in args.rows) + " | row 0 alone = in the batch | twice equal "
          "| max diff to gathered | efficient kernel takes it |")
    print("|---" * (len(args.rows) + 5) + "|")
    for name, method in named.items():
        big = batches[max(args.rows)]
        alone = method(*(t[:1] for t in big))
        once, again = method(*big), method(*big)
        cells = [f"{statistics.median(times[(name, r)]):.1f}" for r in args.rows]
        diff = float((once.float() - reference).abs().max())
        takes = efficient_takes(method, big) if device.type == "cuda" else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {torch.equal(alone[0], once[0])} | "
              f"{torch.equal(once, again)} | {diff:.3g} | {takes} |")


def main() -> None:
    """Parse arguments and run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rows", default="1,8,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--deterministic", action="store_true", help="on CUDA, cuDNN's SDPA off as serving ranks do")
    run(ap.parse_args())


if __name__ == "__main__":
    with torch.inference_mode():
        main()
