"""Decode and prefill speed: shardlm tp 1 and tp 2 against Hugging Face transformers, and the bandwidth floor.

    python bench/decode.py [--quick] [--rounds N] [--new-tokens N] [--no-write]

One run, one checkpoint (the bundled SmolLM2-135M-Instruct, float32 unless said), the machine's cores:
transformers runs in this process with torch.set_num_threads(cores); shardlm's ranks set their own
threads (cores // tp). Every engine is started once and kept for the whole run.

Measured per round, systems in a rotating order so that load from other processes hits them alike:
  decode tokens/s at batch 1 and batch 8 (prompts of PROMPT_LEN tokens, --new-tokens new tokens each,
  EOS disabled so every row runs every step), prefill tokens/s of a PREFILL_LEN-token prompt at batch 1,
  and the memory bandwidth of this process on the same threads (a sum over a buffer far larger than the
  caches, and a copy counted as bytes read), taken right before and right after shardlm tp1's batch-1
  decode sample: this VM's bandwidth moves by up to 2x from one second to the next (33 <-> 60 GB/s
  seen), so each round's decode is compared with the floor of its own moment. Tables report the median over rounds (min-max beside it).

Decode time, defined the same way for both:
  shardlm: GenerateResult.decode_s, timed on rank 0 from after the prefill forward to the last token,
    i.e. (new-1) decode forwards plus sampling; decode tokens = rows x (new-1).
  transformers: a LogitsProcessor records the clock each time generate() hands it logits, which happens
    right after each forward; decode time = last stamp - first stamp ((new-1) forwards plus generate's
    own bookkeeping); decode tokens = rows x (new-1). As a cross-check, wall(generate new tokens) -
    wall(generate 1 token) is reported too.
Prefill time: shardlm's prefill_s (one forward of the prompt, logits of the last position only);
transformers: one forward `model(ids, use_cache=True, logits_to_keep=1)`, the call generate makes first.

Before each sample the script waits (bounded) until the other processes on the host leave the cores
nearly idle, and it records the CPU those processes took during the sample ("foreign CPU").

Without --no-write (and not with --quick) the results replace this benchmark's section of
bench/RESULTS.md, leaving every other section as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from shardlm.atomic import atomic_file
from shardlm.bundled import default_model_dir
from shardlm.models.args import read_config
from shardlm.models.registry import args_for_config
from shardlm.engine import LocalEngine
from shardlm.engine.session import plan_run
from shardlm.engine.text import load_tokenizer, pad_id
from shardlm.plan.plan import KVBudget
from shardlm.plan.run import RunFlags
from shardlm.runtime.protocol import SamplingParams

PROMPT_LEN = 40  # "a few dozen" tokens per decode prompt
PREFILL_LEN = 512
BATCH = 8
WARMUP_NEW = 8
QUIET_CPU = 0.10  # other processes may use at most this share of the cores before a sample starts
RETRY_CPU = 0.20  # a sample during which they used more is taken again ...
TRIES = 3  # ... up to this many times in all; the last try is kept either way
QUIET_WAIT_S = 45.0  # longest wait for quiet before one try
QUIET_BUDGET_S = 300.0  # longest total time spent waiting and on discarded tries in one run
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADING = "## Decode and prefill: shardlm vs transformers (bench/decode.py)"
PAIRED = ("shardlm tp1", "decode_b1")  # the sample the bandwidth floor is measured beside

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a screw press adapted from the wine makers of the Rhine valley. "
    "Within fifty years presses were working in more than two hundred cities across Europe, and the price "
    "of a book fell so far that a craftsman could afford one. Scholars argue about how much this changed: "
    "some say it made the Reformation possible, others that it mostly spread calendars, grammars and "
    "indulgences. What is clear is that the number of copies of a text stopped being limited by the "
    "patience of scribes, and that errors, once printed, travelled just as fast as the truth. "
)


# ---------------------------------------------------------------- CPU accounting


def _cpu_busy_s() -> float:
    """Seconds of non-idle CPU on the whole machine since boot (all cores; steal counted as busy)."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = f[3] + f[4]  # idle + iowait
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds used by this process and its live children (the rank processes)."""
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class ForeignCpu:
    """Share of the cores used by processes other than this benchmark over a timed section."""

    def __enter__(self) -> "ForeignCpu":
        self.t0, self.busy0, self.own0 = time.perf_counter(), _cpu_busy_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        foreign = (_cpu_busy_s() - self.busy0) - (_own_cpu_s() - self.own0)
        self.share = max(0.0, foreign / max(wall * (os.cpu_count() or 1), 1e-9))


@dataclass
class QuietGate:
    """Wait until other processes leave the cores nearly idle, within a per-sample and a total budget."""

    budget_s: float
    waited_s: float = 0.0
    """Time spent waiting for quiet and on discarded tries."""
    retried: int = 0

    @property
    def spent(self) -> bool:
        return self.waited_s >= self.budget_s

    def wait(self) -> None:
        """Return once a 1 s window had other processes below QUIET_CPU (or the budget ran out)."""
        deadline = time.monotonic() + min(QUIET_WAIT_S, max(0.0, self.budget_s - self.waited_s))
        t0 = time.monotonic()
        while True:
            with ForeignCpu() as fc:
                time.sleep(1.0)
            if fc.share < QUIET_CPU or time.monotonic() >= deadline:
                break
        self.waited_s += max(0.0, time.monotonic() - t0 - 1.0)

    def measure(self, fn) -> tuple[float, tuple]:
        """Run `fn` after waiting for quiet; again (up to TRIES) while other processes took the cores."""
        for attempt in range(TRIES):
            self.wait()
            t0 = time.monotonic()
            with ForeignCpu() as fc:
                result = fn()
            if fc.share <= RETRY_CPU or attempt == TRIES - 1 or self.spent:
                return fc.share, result
            self.retried += 1
            self.waited_s += time.monotonic() - t0
        raise AssertionError("unreachable")


# ---------------------------------------------------------------- systems


@dataclass
class Sample:
    value: float  # tokens per second
    foreign: float  # share of the cores other processes used meanwhile
    extra: dict = field(default_factory=dict)


@dataclass
class Workload:
    """Token ids the systems share: batch-1 and batch-8 decode prompts and the prefill prompt."""

    one: list[list[int]]
    eight: list[list[int]]
    long: list[list[int]]
    pad: int


class ShardlmSystem:
    """A LocalEngine kept alive for the whole run; EOS is disabled so every row runs every step."""

    def __init__(self, label: str, folder: Path, family, args, tp: int, dtype: str, metrics: tuple[str, ...]):
        self.label, self.tp, self.dtype, self.metrics = label, tp, dtype, metrics
        plan, source = plan_run(str(folder), RunFlags(tp=tp, dtype=dtype), KVBudget(BATCH, 2048, PREFILL_LEN))
        self.engine = LocalEngine(plan, source)
        self._comms = [{} for _ in range(tp)]
        self.peak_rss: list[int] = [0] * tp
        self.tokens_b1: list[int] | None = None

    def start(self) -> None:
        self.engine.start()
        self.load_s = self.engine.load_s
        self.rss_before = [r.get("rss_before_load_bytes") for r in self.engine.ready]
        self.peak_rss = [r.get("peak_rss_bytes", 0) for r in self.engine.ready]

    def _generate(self, prompts: list[list[int]], new: int, pad: int):
        res = self.engine.generate(prompts, new, SamplingParams(), pad, ignore_eos=True)
        if any(len(t) != new for t in res.token_ids):
            raise RuntimeError(f"{self.label}: a row stopped before {new} tokens; EOS was meant to be disabled")
        self.peak_rss = [max(a, r["peak_rss_bytes"]) for a, r in zip(self.peak_rss, res.ranks)]
        delta = _comms_delta(self._comms[0], res.ranks[0]["comms"])
        self._comms = [r["comms"] for r in res.ranks]
        return res, delta

    def decode(self, prompts: list[list[int]], new: int, pad: int) -> tuple[float, dict]:
        res, comms = self._generate(prompts, new, pad)
        steps = res.decode_tokens // len(prompts)
        extra = {"decode_s": res.decode_s, "steps": steps}
        if self.tp > 1:
            extra["comm_s_per_step"] = sum(c["seconds"] for c in comms.values()) / steps
            extra["comm_calls_per_step"] = sum(c["calls"] for c in comms.values()) / steps
        if len(prompts) == 1:
            self.tokens_b1 = res.token_ids[0]
        return res.decode_tokens / res.decode_s, extra

    def prefill(self, prompt: list[int], pad: int) -> tuple[float, dict]:
        res, _ = self._generate([prompt], 1, pad)
        return res.prompt_tokens / res.prefill_s, {"prefill_s": res.prefill_s}

    def stop(self) -> None:
        self.engine.stop()


def _comms_delta(before: dict, after: dict) -> dict:
    """Per-op counters of one generate call (the rank reports running totals)."""
    return {op: {k: v - before.get(op, {}).get(k, 0) for k, v in c.items()} for op, c in after.items()}


class TransformersSystem:
    """AutoModelForCausalLM in this process, greedy generate with EOS disabled."""

    def __init__(self, label: str, folder: Path, dtype: torch.dtype, metrics: tuple[str, ...]):
        self.label, self.folder, self.torch_dtype, self.metrics = label, folder, dtype, metrics
        self.tp, self.dtype = 1, str(dtype).removeprefix("torch.")
        self.tokens_b1: list[int] | None = None

    def start(self) -> None:
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(self.folder), dtype=self.torch_dtype).eval()
        self.model.generation_config.eos_token_id = None  # run every step, like shardlm with EOS disabled
        self.load_s = time.perf_counter() - t0
        self.params = sum(p.numel() for p in self.model.parameters())  # a tied embedding is listed once

    def _generate(self, ids: torch.Tensor, new: int, pad: int, clock=None) -> tuple[torch.Tensor, float]:
        from transformers import LogitsProcessorList

        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                      pad_token_id=pad, logits_processor=LogitsProcessorList([clock] if clock else []))
        wall = time.perf_counter() - t0
        if out.shape[1] != ids.shape[1] + new:
            raise RuntimeError(f"{self.label}: generate returned {out.shape[1] - ids.shape[1]} tokens, wanted {new}")
        return out[:, ids.shape[1]:], wall

    def decode(self, prompts: list[list[int]], new: int, pad: int) -> tuple[float, dict]:
        ids = torch.tensor(prompts, dtype=torch.long)  # all prompts have one length: no padding
        clock = _Clock()
        out, wall_n = self._generate(ids, new, pad, clock)
        _, wall_1 = self._generate(ids, 1, pad)
        if len(clock.stamps) != new:
            raise RuntimeError(f"{self.label}: the clock saw {len(clock.stamps)} steps, wanted {new}")
        b, steps = len(prompts), new - 1
        decode_s = clock.stamps[-1] - clock.stamps[0]
        if b == 1:
            self.tokens_b1 = out[0].tolist()
        return b * steps / decode_s, {"decode_s": decode_s, "steps": steps,
                                      "subtraction_tok_s": b * steps / max(wall_n - wall_1, 1e-9)}

    def prefill(self, prompt: list[int], pad: int) -> tuple[float, dict]:
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
            took = time.perf_counter() - t0
        return len(prompt) / took, {"prefill_s": took}

    def stop(self) -> None:
        self.model = None


class _Clock:
    """A LogitsProcessor that only stamps the time: generate calls it once per forward, right after it."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


# ---------------------------------------------------------------- bandwidth


def measure_bandwidth(read_mib: int = 1024, copy_mib: int = 512, reps: int = 10) -> dict[str, float]:
    """GB/s (1e9 bytes) on this process's threads: sum over `read_mib`, copy of `copy_mib` (bytes read)."""
    big = torch.ones(read_mib * 2**20 // 4)
    big.sum()  # first touch and warm-up
    t_sum = []
    for _ in range(reps):
        t0 = time.perf_counter()
        big.sum()
        t_sum.append(time.perf_counter() - t0)
    read = big.nbytes / statistics.median(t_sum) / 1e9
    del big
    a = torch.ones(copy_mib * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    t_copy = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        t_copy.append(time.perf_counter() - t0)
    copy = a.nbytes / statistics.median(t_copy) / 1e9
    return {"read": read, "copy": copy}


# ---------------------------------------------------------------- the run


def make_workload(tok, pad: int) -> Workload:
    ids = tok(TEXT * 8, add_special_tokens=False)["input_ids"]
    need = max(PREFILL_LEN, BATCH * PROMPT_LEN)
    if len(ids) < need:
        raise RuntimeError(f"the benchmark text gives {len(ids)} tokens, needs {need}")
    eight = [ids[i * PROMPT_LEN:(i + 1) * PROMPT_LEN] for i in range(BATCH)]
    return Workload(one=eight[:1], eight=eight, long=[ids[:PREFILL_LEN]], pad=pad)


def run_metric(system, metric: str, work: Workload, new: int) -> tuple[float, dict]:
    if metric == "decode_b1":
        return system.decode(work.one, new, work.pad)
    if metric == "decode_b8":
        return system.decode(work.eight, new, work.pad)
    return system.prefill(work.long[0], work.pad)


def run_rounds(systems, work: Workload, rounds: int, new: int, gate: QuietGate, say) -> tuple[dict, list]:
    samples: dict[tuple[str, str], list[Sample]] = {}
    bandwidth: list[dict] = []
    for r in range(rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            for metric in system.metrics:
                paired = (system.label, metric) == PAIRED  # the floor of this very sample: the VM's memory
                before = _bandwidth(gate, r, rounds, say, "before") if paired else None  # bandwidth moves
                share, (value, extra) = gate.measure(lambda: run_metric(system, metric, work, new))  # by seconds
                samples.setdefault((system.label, metric), []).append(Sample(value, share, extra))
                say(f"round {r + 1}/{rounds}  {system.label:<22} {metric:<11} {value:8.1f} tok/s  "
                    f"(other processes: {share:.0%} of the cores; waited/discarded {gate.waited_s:.0f} s so far)")
                if paired:
                    after = _bandwidth(gate, r, rounds, say, "after")
                    bandwidth.append({k: (before[k] + after[k]) / 2 for k in after} |
                                     {"spread": (before["read"], after["read"])})
        if len(bandwidth) == r:  # no tp1 batch-1 sample this round
            bandwidth.append(_bandwidth(gate, r, rounds, say))
    return samples, bandwidth


def _spread(b: dict) -> str:
    """A round's read bandwidth, with its before/after readings when it has them."""
    return f"{b['read']:.1f}" + (f" ({b['spread'][0]:.1f}/{b['spread'][1]:.1f})" if "spread" in b else "")


def _bandwidth(gate: QuietGate, r: int, rounds: int, say, when: str = "") -> dict:
    share, bw = gate.measure(measure_bandwidth)
    bw["foreign"] = share
    say(f"round {r + 1}/{rounds}  memory bandwidth {when}: sum {bw['read']:.1f} GB/s, copy {bw['copy']:.1f} GB/s "
        f"read (other processes: {share:.0%})")
    return bw


def warm_up(systems, work: Workload, say) -> None:
    """One short pass of every shape per system (oneDNN primitives, allocator pools), not timed."""
    for system in systems:
        for metric in system.metrics:
            run_metric(system, metric, work, WARMUP_NEW)
        say(f"warmed up {system.label}")


def machine_info() -> dict[str, str]:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    import transformers

    return {
        "cores": f"{os.cpu_count()} (nproc {len(os.sched_getaffinity(0))})",
        "cpu": f"{model} ({isa})",
        "ram": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------- reporting


def med(samples: list[Sample] | None) -> float | None:
    return statistics.median(s.value for s in samples) if samples else None


def cell(samples: list[Sample] | None) -> str:
    if not samples:
        return "-"
    vals = [s.value for s in samples]
    m = statistics.median(vals)
    return f"{m:.1f}" if len(vals) == 1 else f"{m:.1f} ({min(vals):.1f}-{max(vals):.1f})"


def summarize(systems, samples, bandwidth, wbytes: dict[str, int]) -> dict:
    """Medians, the floor and the target ratios, as numbers and as rows for the tables."""
    get = lambda label, metric: med(samples.get((label, metric)))  # noqa: E731
    read_bw = statistics.median(b["read"] for b in bandwidth) * 1e9
    copy_bw = statistics.median(b["copy"] for b in bandwidth) * 1e9
    floor = read_bw / wbytes["float32"]
    floor_low = min(b["read"] for b in bandwidth) * 1e9 / wbytes["float32"]
    tp1, tp2, hf = (get(n, "decode_b1") for n in ("shardlm tp1", "shardlm tp2", "transformers"))
    tp1_8, tp2_8, hf_8 = (get(n, "decode_b8") for n in ("shardlm tp1", "shardlm tp2", "transformers"))
    tp1_rounds = [x.value for x in samples.get(PAIRED, [])]
    paired = [v / (b["read"] * 1e9 / wbytes["float32"]) for v, b in zip(tp1_rounds, bandwidth)]
    targets = [
        ("tp1 decode >= 1.2x transformers (batch 1)", tp1 / hf, 1.2, "x", ""),
        ("tp1 decode >= 60% of the bandwidth floor (batch 1)", statistics.median(paired), 0.6, "%",
         "median over rounds of the sample / the floor measured around it: "
         + ", ".join(f"{x:.0%}" for x in paired) + f"; median tok/s / median floor {tp1 / floor:.0%}, "
         f"{tp1 / floor_low:.0%} against the lowest round's floor"),
        ("tp2 decode >= 0.8x tp1 (batch 1)", tp2 / tp1, 0.8, "x", ""),
        ("(batch 8, for reference) tp1 >= 1.2x transformers", tp1_8 / hf_8, 1.2, "x", ""),
        ("(batch 8, for reference) tp2 >= 0.8x tp1", tp2_8 / tp1_8, 0.8, "x", ""),
    ]
    return {"read_bw": read_bw, "copy_bw": copy_bw, "floor": floor,
            "floor_copy": copy_bw / wbytes["float32"], "floor_low": floor_low, "floor_bf16": read_bw / wbytes["bfloat16"],
            "targets": targets}


def rss_cell(sy) -> str:
    """Peak RSS per rank in MiB, with the growth over the rank's RSS before it loaded weights."""
    if not hasattr(sy, "peak_rss"):
        return "(in the driver)"
    parts = []
    for peak, before in zip(sy.peak_rss, sy.rss_before):
        parts.append(f"{peak / 2**20:.0f}" + (f" (+{(peak - before) / 2**20:.0f})" if before else ""))
    return " / ".join(parts)


def fmt_ratio(value: float, unit: str) -> str:
    return f"{value:.0%}" if unit == "%" else f"{value:.2f}x"


def markdown(cfg: dict) -> str:
    """This benchmark's section of RESULTS.md."""
    systems, samples, s, info = cfg["systems"], cfg["samples"], cfg["summary"], cfg["info"]
    out = [HEADING, "",
           f"Command: `{cfg['command']}` ({cfg['rounds']} rounds, {cfg['new']} new tokens, median (min-max) "
           f"over rounds). Date: {cfg['date']}.", "",
           f"Machine: {info['cores']} cores, {info['cpu']}, {info['ram']} RAM; python {info['python']}, torch "
           f"{info['torch']}, transformers {info['transformers']}. Model: bundled SmolLM2-135M-Instruct "
           f"({cfg['params'] / 1e6:.1f} M parameters). Threads: transformers {cfg['threads']}, shardlm cores // tp "
           "per rank.", "",
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
        out.append(f"| {name} | {fmt_ratio(value, unit)} (goal {fmt_ratio(goal, unit)}{'; ' + note if note else ''}) | "
                   f"{'yes' if value >= goal else '**no**'} |")
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
                 ("shardlm tp1 bf16", "shardlm tp1"), ("transformers bf16", "transformers")):  # rounding drift
        ta, tb = getattr(by.get(a), "tokens_b1", None), getattr(by.get(b), "tokens_b1", None)
        if ta and tb:
            same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            notes.append(f"Greedy tokens, batch 1: {a} and {b} agree on the first {same} of {len(ta)}.")
    return [f"- {n}" for n in notes]


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
                   "[green]yes[/]" if value >= goal else "[red]no[/]")
    console.print(tt)
    for n in cfg["notes"]:
        console.print(n, highlight=False)
    console.print(f"load average at start: {cfg['uptime_start']}\nload average at end:   {cfg['uptime_end']}")


def write_section(text: str, heading: str = HEADING) -> None:
    """Replace the section of RESULTS.md under `heading` (up to the next '## ' heading) with `text`,
    or append it; every benchmark script records its results through this."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    lines = old.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        new = old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        rest = "\n".join(lines[end:])
        new = "\n".join(lines[:start]) + "\n" + text.rstrip("\n") + "\n" + ("\n" + rest + "\n" if rest else "")
    with atomic_file(RESULTS) as f:
        f.write(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 round, 32 new tokens, RESULTS.md untouched")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, --quick 1)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per decode run (default 128, --quick 32)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md as it is")
    opts = ap.parse_args()
    rounds = opts.rounds or (1 if opts.quick else 3)
    new = opts.new_tokens or (32 if opts.quick else 128)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    say = lambda msg: print(msg, flush=True)  # noqa: E731

    uptime_start = uptime()
    say(f"start: {uptime_start}")
    folder = default_model_dir()
    family, args = args_for_config(read_config(folder))
    tok = load_tokenizer(folder)
    work = make_workload(tok, pad_id(tok))
    fp32_bf16 = ("decode_b1", "prefill")
    systems = [
        ShardlmSystem("shardlm tp1", folder, family, args, 1, "float32", ("decode_b1", "decode_b8", "prefill")),
        ShardlmSystem("shardlm tp2", folder, family, args, 2, "float32", ("decode_b1", "decode_b8", "prefill")),
        TransformersSystem("transformers", folder, torch.float32, ("decode_b1", "decode_b8", "prefill")),
        ShardlmSystem("shardlm tp1 bf16", folder, family, args, 1, "bfloat16", fp32_bf16),
        TransformersSystem("transformers bf16", folder, torch.bfloat16, fp32_bf16),
    ]
    try:
        for sy in systems:
            sy.start()
            say(f"started {sy.label} in {sy.load_s:.1f} s")
        warm_up(systems, work, say)
        gate = QuietGate(QUIET_BUDGET_S)
        samples, bandwidth = run_rounds(systems, work, rounds, new, gate, say)
    finally:
        for sy in systems:
            sy.stop()
    params = next(sy for sy in systems if sy.label == "transformers").params
    wbytes = {"float32": params * 4, "bfloat16": params * 2}
    foreign = [x.foreign for ss in samples.values() for x in ss]
    cfg = {
        "systems": systems, "samples": samples, "bandwidth": bandwidth, "rounds": rounds, "new": new,
        "wbytes": wbytes, "params": params, "threads": cores, "info": machine_info(),
        "command": "python bench/decode.py" + (" --quick" if opts.quick else ""),
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "uptime_start": uptime_start, "uptime_end": uptime(),
        "foreign_median": statistics.median(foreign), "foreign_max": max(foreign), "waited_s": gate.waited_s,
        "retried": gate.retried,
        "summary": summarize(systems, samples, bandwidth, wbytes), "notes": collect_notes(systems, samples),
    }
    print_tables(cfg)
    if opts.quick or opts.no_write:
        say(f"{RESULTS.name} not written ({'--quick' if opts.quick else '--no-write'})")
    else:
        write_section(markdown(cfg))
        say(f"wrote the section '{HEADING}' of {RESULTS}")


if __name__ == "__main__":
    sys.exit(main())
