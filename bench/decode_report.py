"""bench/decode.py's report: medians, the bandwidth floors, the targets, notes, the terminal tables and the
RESULTS.md section."""

from __future__ import annotations

import statistics
import sys

from decode_common import QUIET_BUDGET_S, QUIET_CPU, QUIET_WAIT_S, RETRY_CPU, TRIES, cell, fmt_ratio, med

HEADING = "## Decode and prefill: shardlm vs transformers (bench/decode.py)"
PAIRED = ("shardlm tp1", "decode_b1")  # the sample the round's bandwidth floor is measured beside
OWN_FLOOR = ("shardlm tp1", "shardlm tp1 bf16", "shardlm tp1 int8", "shardlm tp1 int4")
"""Systems whose batch-1 decode samples each get the read bandwidth of their own moment (Sample.extra["read"])."""


def _spread(b: dict) -> str:
    """A round's read bandwidth, with its before/after readings when it has them."""
    return f"{b['read']:.1f}" + (f" ({b['spread'][0]:.1f}/{b['spread'][1]:.1f})" if "spread" in b else "")


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _floor_share(system, tok_s: float | None, read_bw: float) -> tuple[float | None, str]:
    """Batch-1 decode as a share of its own floor (the bytes a step reads / the median read bandwidth)."""
    nbytes = getattr(system, "weight_bytes", None) or getattr(system, "file_bytes", None)
    if tok_s is None or not nbytes:
        return None, ""
    return tok_s / (read_bw / nbytes), f"{nbytes / 1e6:.1f} MB a token, floor {read_bw / nbytes:.1f} tok/s"


def _own_floor_share(system, got: list, tok_s: float | None, read_bw: float) -> tuple[float | None, str]:
    """Batch-1 decode against the floor of each sample's own moment (median over rounds), with the figure against
    the median bandwidth beside it; _floor_share where the samples carry no bandwidth of their own."""
    share, how = _floor_share(system, tok_s, read_bw)
    nbytes = getattr(system, "weight_bytes", None)
    own = [x.value / (x.extra["read"] * 1e9 / nbytes) for x in got if "read" in x.extra] if nbytes else []
    if not own:
        return share, how
    return statistics.median(own), ("median over rounds of the sample / the floor measured around it: "
                                    + ", ".join(f"{x:.0%}" for x in own) + f"; median tok/s / median floor "
                                    f"{share:.0%}; " + how)


def summarize(systems, samples, bandwidth, wbytes: dict[str, int]) -> dict:
    """Medians, the floor and the target ratios, as numbers and as rows for the tables (None: not measured)."""
    get = lambda label, metric: med(samples.get((label, metric)))  # noqa: E731
    by = {sy.label: sy for sy in systems}
    read_bw = statistics.median(b["read"] for b in bandwidth) * 1e9
    copy_bw = statistics.median(b["copy"] for b in bandwidth) * 1e9
    floor = read_bw / wbytes["float32"]
    floor_low = min(b["read"] for b in bandwidth) * 1e9 / wbytes["float32"]
    tp1, tp2, hf = (get(n, "decode_b1") for n in ("shardlm tp1", "shardlm tp2", "transformers"))
    tp1_8, tp2_8, hf_8 = (get(n, "decode_b8") for n in ("shardlm tp1", "shardlm tp2", "transformers"))
    tp1_rounds = [x.value for x in samples.get(PAIRED, [])]
    paired = [v / (b["read"] * 1e9 / wbytes["float32"]) for v, b in zip(tp1_rounds, bandwidth)]
    targets = [
        ("tp1 decode >= 1.2x transformers (batch 1)", _div(tp1, hf), 1.2, "x", ""),
        ("tp1 decode >= 60% of the bandwidth floor (batch 1)", statistics.median(paired), 0.6, "%",
         "median over rounds of the sample / the floor measured around it: "
         + ", ".join(f"{x:.0%}" for x in paired) + f"; median tok/s / median floor {tp1 / floor:.0%}, "
         f"{tp1 / floor_low:.0%} against the lowest round's floor"),
        ("tp2 decode >= 0.8x tp1 (batch 1)", _div(tp2, tp1), 0.8, "x", ""),
        ("(batch 8, for reference) tp1 >= 1.2x transformers", _div(tp1_8, hf_8), 1.2, "x", ""),
        ("(batch 8, for reference) tp2 >= 0.8x tp1", _div(tp2_8, tp1_8), 0.8, "x", ""),
    ]
    ours = (("float32", "shardlm tp1", "llama.cpp f32", 0.8), ("bfloat16", "shardlm tp1 bf16", "llama.cpp f16", 0.8),
            ("int8", "shardlm tp1 int8", "llama.cpp q8_0", 0.75), ("int4", "shardlm tp1 int4", "llama.cpp q4_1", 0.75))
    for fmt, mine, peer, share in ours:
        a, b = get(mine, "decode_b1"), get(peer, "decode_b1")
        targets.append((f"{fmt} decode >= 1.0x {peer} (batch 1)", _div(a, b), 1.0, "x", ""))
        got, how = _own_floor_share(by.get(mine), samples.get((mine, "decode_b1"), []), a, read_bw)
        targets.append((f"{fmt} decode >= {share:.0%} of its bandwidth floor (batch 1)", got, share, "%", how))
    targets.append(("float32 decode >= 1.0x llama.cpp f32 (batch 8)", _div(tp1_8, get("llama.cpp f32", "decode_b8")),
                    1.0, "x", ""))
    pre = {n: get(n, "prefill") for n in by}
    for mine, peer, hf_name in (("shardlm tp1", "llama.cpp f32", "transformers"),
                                ("shardlm tp1 bf16", "llama.cpp f16", "transformers bf16")):
        targets.append((f"{mine} prefill >= 1.0x {peer}", _div(pre.get(mine), pre.get(peer)), 1.0, "x", ""))
        targets.append((f"{mine} prefill >= 1.2x {hf_name}", _div(pre.get(mine), pre.get(hf_name)), 1.2, "x", ""))
    for q in ("int8", "int4"):
        targets.append((f"{q} prefill >= 1.0x float32 prefill", _div(pre.get(f"shardlm tp1 {q}"),
                                                                       pre.get("shardlm tp1")), 1.0, "x", ""))
    return {"read_bw": read_bw, "copy_bw": copy_bw, "floor": floor,
            "floor_copy": copy_bw / wbytes["float32"], "floor_low": floor_low, "floor_bf16": read_bw / wbytes["bfloat16"],
            "targets": targets}


def met(value: float | None, goal: float) -> str:
    """yes / no / not measured (a peer not run)."""
    return "not measured" if value is None else "yes" if value >= goal else "no"


def rss_cell(sy) -> str:
    """Peak RSS per rank in MiB, with the growth over the rank's RSS before it loaded weights."""
    if not hasattr(sy, "peak_rss"):
        return "(in the driver)"
    parts = []
    for peak, before in zip(sy.peak_rss, sy.rss_before):
        parts.append(f"{peak / 2**20:.0f}" + (f" (+{(peak - before) / 2**20:.0f})" if before else ""))
    return " / ".join(parts)


def markdown(cfg: dict) -> str:
    """This benchmark's section of RESULTS.md."""
    systems, samples, s, info = cfg["systems"], cfg["samples"], cfg["summary"], cfg["info"]
    out = [HEADING, "",
           f"Command: `{cfg['command']}` ({cfg['rounds']} rounds, {cfg['new']} new tokens, median (min-max) "
           f"over rounds). Date: {cfg['date']}.", "",
           f"Machine: {info['cores']} cores, {info['cpu']}, {info['ram']} RAM; python {info['python']}, torch "
           f"{info['torch']}, transformers {info['transformers']}. Model: bundled SmolLM2-135M-Instruct "
           f"({cfg['params'] / 1e6:.1f} M parameters). Threads: transformers and llama.cpp {cfg['threads']}, shardlm "
           "cores // tp per rank." + (f" llama.cpp: {info['llamacpp']}." if "llamacpp" in info else ""), "",
           "shardlm int8 and int4 run with `--quantize-embedding` (the tied embedding/head as int8 rows), as "
           "llama.cpp's Q8_0 and the bundled Q4_1 file hold theirs (Q8_0). A system's bandwidth floor is the bytes "
           "its batch-1 step reads (shardlm: rank 0's resident weights as the rank reports them; llama.cpp: the GGUF "
           "file) over the read bandwidth: for shardlm tp 1's batch-1 decode, the bandwidth measured right before and "
           "after each sample (the median over rounds of each sample's share), otherwise the median over rounds.", "",
           f"Load average: start `{cfg['uptime_start']}`; end `{cfg['uptime_end']}`. Other processes used "
           f"{cfg['foreign_median']:.0%} of the cores during the median sample (max {cfg['foreign_max']:.0%}); "
           f"{cfg['retried']} samples were taken again because of them; {cfg['waited_s']:.0f} s went to waiting for "
           "quiet cores and to discarded tries.", "",
           "| system | dtype | decode tok/s, batch 1 | decode tok/s, batch 8 | prefill tok/s, 512 tokens | load s | "
           "peak RSS per rank, MiB (growth from before loading) |",
           "|---|---|---|---|---|---|---|"]
    for sy in systems:
        rss = rss_cell(sy)
        out.append(f"| {sy.label} | {sy.dtype} | {cell(samples.get((sy.label, 'decode_b1')))} | "
                   f"{cell(samples.get((sy.label, 'decode_b8')))} | {cell(samples.get((sy.label, 'prefill')))} | "
                   f"{sy.load_s:.1f} | {rss} |")
    out += ["", f"Bandwidth floor (batch 1 decode): weights {cfg['wbytes']['float32'] / 1e6:.1f} MB float32 "
                f"({cfg['wbytes']['bfloat16'] / 1e6:.1f} MB bfloat16; all parameters, the tied embedding once) "
                f"streamed once per step. Measured read bandwidth (`big.sum()` over 1 GiB, {cfg['threads']} threads) "
                f"{s['read_bw'] / 1e9:.1f} GB/s (median over rounds; each round's figure is the mean of two medians "
                "of 10 passes, taken right before and right after its shardlm tp1 batch-1 decode sample; rounds, "
                "before/after: "
                + ", ".join(_spread(b) for b in cfg["bandwidth"]) + "), copy (`b.copy_(a)`, 512 MiB, counted "
                f"as bytes read) {s['copy_bw'] / 1e9:.1f} GB/s. Floor: **{s['floor']:.1f} tok/s float32** "
                f"({s['floor_low']:.1f} from the lowest round, {s['floor_copy']:.1f} from the copy bandwidth), "
                f"{s['floor_bf16']:.1f} tok/s bfloat16.", "",
            "| target | measured | met? |", "|---|---|---|"]
    for name, value, goal, unit, note in s["targets"]:
        verdict = met(value, goal)
        out.append(f"| {name} | {fmt_ratio(value, unit)} (goal {fmt_ratio(goal, unit)}{'; ' + note if note else ''}) | "
                   f"{'**no**' if verdict == 'no' else verdict} |")
    out += ["", *cfg["notes"], "", "Samples per round (tok/s; other processes' share of the cores):", ""]
    for (label, metric), ss in samples.items():
        out.append(f"- {label}, {metric}: " + ", ".join(f"{x.value:.1f} ({x.foreign:.0%})" for x in ss))
    out.append("- memory bandwidth sum/copy GB/s: " + ", ".join(
        f"{b['read']:.1f}/{b['copy']:.1f} ({b['foreign']:.0%})" for b in cfg["bandwidth"]))
    out += ["", "Method: decode time is taken from after the prefill forward to the last new token, for both "
                "systems: shardlm's rank-0 `decode_s`; for transformers a LogitsProcessor that stamps the clock "
                "each time `generate` hands it logits (once per forward, right after it), last stamp minus first. "
                "Decode tokens = rows x (new tokens - 1). EOS is disabled on both (shardlm: "
                "`eos_token_ids=()`; transformers: `generation_config.eos_token_id = None`), and every run is "
                "checked to have produced all its tokens. Prefill: shardlm's `prefill_s` (one forward, last-position "
                "logits); transformers: one `model(ids, use_cache=True, logits_to_keep=1)` call, what `generate` "
                "does first. Each system is warmed up once per shape before the rounds; systems run in a rotating "
                "order each round. The host is shared (other sessions run test suites on the same 2 cores), so "
                f"before each sample the script waits (at most {QUIET_WAIT_S:.0f} s) for a 1 s window in which other "
                f"processes used under {QUIET_CPU:.0%} of the cores, and a sample during which they used more than "
                f"{RETRY_CPU:.0%} is taken again, up to {TRIES} tries, the last one kept whatever it saw; waits and "
                f"discarded tries share a budget of {QUIET_BUDGET_S:.0f} s per run. Every kept sample is listed "
                "above with the share other processes took during it.", ""]
    return "\n".join(out)


def collect_notes(systems, samples) -> list[str]:
    """tp2 collective time, the transformers cross-check, and greedy-token agreement."""
    by = {sy.label: sy for sy in systems}
    notes = []
    for metric in ("decode_b1", "decode_b8"):
        ss = samples.get(("shardlm tp2", metric))
        if ss and "comm_s_per_step" in ss[0].extra:
            per = statistics.median(x.extra["comm_s_per_step"] for x in ss)
            calls = statistics.median(x.extra["comm_calls_per_step"] for x in ss)
            step = statistics.median(x.extra["decode_s"] / x.extra["steps"] for x in ss)
            notes.append(f"tp2 collectives, {metric}: {per * 1e3:.2f} ms per decode step on rank 0 "
                         f"({calls:.0f} calls per step, {per / step:.0%} of the {step * 1e3:.1f} ms step; "
                         "rank 0's counters over the whole call divided by its decode steps, so the one prefill "
                         "forward is included).")
    for label in ("transformers", "transformers bf16"):
        for metric in ("decode_b1", "decode_b8"):
            ss = samples.get((label, metric))
            if ss:
                sub = statistics.median(x.extra["subtraction_tok_s"] for x in ss)
                notes.append(f"{label} {metric} cross-check by subtraction, (wall of {ss[0].extra['steps'] + 1}-token "
                             f"generate - wall of 1-token generate): {sub:.1f} tok/s (the clock method gave "
                             f"{med(ss):.1f}).")
    for a, b in (("shardlm tp1", "transformers"), ("shardlm tp2", "shardlm tp1"),
                 ("shardlm tp1 bf16", "transformers bf16"),  # bfloat16 against each system's own float32:
                 ("shardlm tp1 bf16", "shardlm tp1"), ("transformers bf16", "transformers"),  # rounding drift
                 ("llama.cpp f32", "shardlm tp1"), ("shardlm tp1 int8", "shardlm tp1"),
                 ("shardlm tp1 int4", "shardlm tp1"), ("llama.cpp q8_0", "llama.cpp f32"),
                 ("llama.cpp q4_1", "llama.cpp f32")):
        ta, tb = getattr(by.get(a), "tokens_b1", None), getattr(by.get(b), "tokens_b1", None)
        if ta and tb:
            notes.append(f"Greedy tokens, batch 1: {a} and {b} agree on the first {_agree(ta, tb)} of {len(ta)}.")
    for sy in systems:  # the batch's first row has the batch-1 prompt: does the batch change its tokens?
        one, row0 = getattr(sy, "tokens_b1", None), getattr(sy, "tokens_b8_row0", None)
        if one and row0:
            n = _agree(one, row0)
            notes.append(f"{sy.label}: row 0 of the batch of 8 " + ("equals its batch-1 tokens" if n == len(one) else
                                                                    f"leaves its batch-1 tokens at token {n}") + ".")
    return [f"- {n}" for n in notes]


def _agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def print_tables(cfg: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    t = Table(title=f"decode / prefill tokens/s, median (min-max) of {cfg['rounds']} rounds, {cfg['new']} new tokens")
    for col in ("system", "dtype", "decode b1", "decode b8", "prefill 512", "load s", "peak RSS/rank MiB"):
        t.add_column(col, justify="left" if col in ("system", "dtype") else "right")
    for sy in cfg["systems"]:
        rss = rss_cell(sy)
        t.add_row(sy.label, sy.dtype, *(cell(cfg["samples"].get((sy.label, m))) for m in
                                        ("decode_b1", "decode_b8", "prefill")), f"{sy.load_s:.1f}", rss)
    console.print(t)
    s = cfg["summary"]
    console.print(f"bandwidth: sum {s['read_bw'] / 1e9:.1f} GB/s, copy {s['copy_bw'] / 1e9:.1f} GB/s (read); "
                  f"weights {cfg['wbytes']['float32'] / 1e6:.1f} MB -> floor {s['floor']:.1f} tok/s float32 "
                  f"({s['floor_bf16']:.1f} bfloat16)")
    tt = Table(title="targets")
    for col in ("target", "measured", "goal", "met"):
        tt.add_column(col)
    for name, value, goal, unit, note in s["targets"]:
        tt.add_row(name, fmt_ratio(value, unit) + (f" ({note})" if note else ""), fmt_ratio(goal, unit),
                   {"yes": "[green]yes[/]", "no": "[red]no[/]"}.get(met(value, goal), "-"))
    console.print(tt)
    for n in cfg["notes"]:
        console.print(n, highlight=False)
    console.print(f"load average at start: {cfg['uptime_start']}\nload average at end:   {cfg['uptime_end']}")


