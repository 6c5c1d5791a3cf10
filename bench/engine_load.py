"""Closed-loop load on the serving engine in-process (no HTTP, no client process): where a concurrency's time goes.

    python bench/engine_load.py [--concurrency 16] [--requests 64] [--input-len 64] [--output-len 64]
                                [--dtype float32] [--rounds 2]

The shape of `bench/serve.py`'s runs (random token prompts, sampled at temperature 1 as vLLM's client leaves the
servers' default, or greedy with --temperature 0; EOS ignored, a new request as soon as one finishes), sent to
`shardlm.engine.Engine` from threads of this process, with the bundled model on one rank and the
plan `shardlm serve --max-batch C --max-seq-len 1024` makes. Prints, per round: output tok/s, TTFT p50 and the
driver's CPU seconds; then, over the last round, the ranks' seconds per step by kind (decode-only steps by rows,
steps with prefill by prompt tokens): what a faster decode step or prefill would buy at this concurrency, without
the HTTP server and the benchmark client sharing the CPUs. Numbers are printed, not written to RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import random
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _engine_class():
    """Engine that keeps (prefill tokens, decode rows, rank seconds) of every step it applies."""
    from shardlm.engine.service import Engine

    class TimedEngine(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps: list[tuple[int, int, float]] = []
            self.last = None

        def _receive_step(self, runs: int = 1):  # what `_apply` waits for: the step's result, with its rank seconds
            self.last = super()._receive_step(runs)
            return self.last

        def _apply(self, step) -> None:
            super()._apply(step)
            seconds = getattr(self.last, "seconds", 0.0)
            self.steps.append((sum(len(p.tokens) for p in step.prefills), len(step.decodes) * step.repeat, seconds))

    return TimedEngine


def one_round(engine, prompts: list[list[int]], concurrency: int, output_len: int, temperature: float = 0.0) -> dict:
    """Every prompt through the engine, `concurrency` at a time; output tok/s, TTFT p50, driver CPU."""
    from shardlm.engine.requests import GenerationParams

    todo = iter(range(len(prompts)))
    lock = threading.Lock()
    ttft: list[float] = []

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            t0 = time.perf_counter()
            req = engine.submit(prompts[i], GenerationParams(max_tokens=output_len, temperature=temperature, seed=i,
                                                                ignore_eos=True))
            first = None
            for _ in engine.stream(req, timeout=300):
                first = time.perf_counter() - t0 if first is None else first
            if first is None:
                raise RuntimeError(f"request {i} ended without an event; the engine's log says why")
            ttft.append(first)

    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    wall, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    return {"tok_s": len(prompts) * output_len / wall, "wall_s": wall, "ttft_p50_ms": statistics.median(ttft) * 1e3,
            "driver_cpu_s": cpu}


def step_table(steps: list[tuple[int, int, float]]) -> list[str]:
    """Lines: rank seconds by step kind (decode-only by rows; with prefill by prompt tokens)."""
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for prefill, rows, seconds in steps:
        kinds[f"prefill {prefill} tokens + {rows} decode rows" if prefill else f"decode {rows} rows"].append(seconds)
    total = sum(s for _, _, s in steps)
    lines = [f"{len(steps)} steps, {total:.2f} rank seconds"]
    for name, secs in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {name}: {len(secs)} steps, median {statistics.median(secs) * 1e3:.1f} ms, "
                     f"{sum(secs):.2f} s ({sum(secs) / total:.0%})")
    return lines


def main() -> None:
    """Run the rounds and print what each took."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="as bench/serve.py's requests: vLLM's client sends none, so servers sample at 1.0; 0: greedy")
    args = ap.parse_args()
    from shardlm.engine.session import plan_run
    from shardlm.plan.plan import KVBudget
    from shardlm.plan.run import RunFlags

    plan, source = plan_run(None, RunFlags(dtype=args.dtype), kv=KVBudget(args.concurrency, 1024, 512))
    rng = random.Random(0)
    vocab = source.args.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.requests)]
    with _engine_class()(plan, source) as engine:
        one_round(engine, prompts[:2], 2, 8)  # warm-up
        for r in range(args.rounds):
            engine.steps.clear()
            got = one_round(engine, prompts, args.concurrency, args.output_len, args.temperature)
            print(f"round {r + 1}: c{args.concurrency}, {args.requests} requests in {got['wall_s']:.2f} s, "
                  f"{got['tok_s']:.1f} output tok/s, TTFT p50 {got['ttft_p50_ms']:.0f} ms, driver CPU "
                  f"{got['driver_cpu_s']:.2f} s", flush=True)
        print("\n".join(step_table(engine.steps)))


if __name__ == "__main__":
    main()
