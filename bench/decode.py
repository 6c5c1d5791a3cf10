"""Decode and prefill speed: shardlm tp 1 and tp 2 against Hugging Face transformers, and the bandwidth floor.

    python bench/decode.py [--quick] [--rounds N] [--new-tokens N] [--no-write]

One run, one checkpoint (the bundled SmolLM2-135M-Instruct, float32 unless said), the machine's cores:
transformers runs in this process with torch.set_num_threads(cores); shardlm's ranks set their own
threads (cores // tp). Every engine is started once and kept for the whole run.

Measured per round, systems in a rotating order so that load from other processes hits them alike:
  decode tokens/s at batch 1 and batch 8 (prompts of PROMPT_LEN tokens, --new-tokens new tokens each,
  EOS disabled so every row runs every step), prefill tokens/s of a PREFILL_LEN-token prompt at batch 1,
  and the memory bandwidth of this process on the same threads (a sum over a buffer far larger than the
  caches, and a copy counted as bytes read), taken right before and right after each shardlm tp 1 batch-1
  decode sample (float32, bfloat16, int8, int4): this VM's bandwidth moves by up to 2x from one second to the next
  (33 <-> 60 GB/s seen), so each sample is compared with the floor of its own moment. Tables report the median over
  rounds (min-max beside it).

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
import datetime as dt
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_common import (QUIET_BUDGET_S, RESULTS, QuietGate, Sample, machine_info, measure_bandwidth,  # noqa: E402
                           uptime, write_section)
from decode_report import HEADING, OWN_FLOOR, PAIRED, collect_notes, markdown, print_tables, summarize  # noqa: E402
import llamacpp  # noqa: E402
from safetensors import safe_open  # noqa: E402
from shardlm.bundled import default_model_dir
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

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a screw press adapted from the wine makers of the Rhine valley. "
    "Within fifty years presses were working in more than two hundred cities across Europe, and the price "
    "of a book fell so far that a craftsman could afford one. Scholars argue about how much this changed: "
    "some say it made the Reformation possible, others that it mostly spread calendars, grammars and "
    "indulgences. What is clear is that the number of copies of a text stopped being limited by the "
    "patience of scribes, and that errors, once printed, travelled just as fast as the truth. "
)


# ---------------------------------------------------------------- systems


@dataclass
class Workload:
    """Token ids the systems share: batch-1 and batch-8 decode prompts and the prefill prompt."""

    one: list[list[int]]
    eight: list[list[int]]
    long: list[list[int]]
    pad: int


class ShardlmSystem:
    """A LocalEngine kept alive for the whole run; EOS is disabled so every row runs every step."""

    def __init__(self, label: str, folder: Path, tp: int, dtype: str, metrics: tuple[str, ...],
                 quantization: str = "none"):
        self.label, self.tp, self.metrics = label, tp, metrics
        self.dtype = dtype if quantization == "none" else f"{quantization} (+ int8 embedding)"
        flags = RunFlags(tp=tp, dtype=dtype, quantization=quantization, quantize_embedding=quantization != "none")
        plan, source = plan_run(str(folder), flags, KVBudget(BATCH, 2048, PREFILL_LEN))
        self.engine = LocalEngine(plan, source)
        self._comms = [{} for _ in range(tp)]
        self.peak_rss: list[int] = [0] * tp
        self.tokens_b1: list[int] | None = None
        self.tokens_b8_row0: list[int] | None = None

    def start(self) -> None:
        self.engine.start()
        self.load_s = self.engine.load_s
        self.rss_before = [r.get("rss_before_load_bytes") for r in self.engine.ready]
        self.peak_rss = [r.get("peak_rss_bytes", 0) for r in self.engine.ready]
        self.weight_bytes: int | None = None  # rank 0's weights: what a batch-1 step reads, for its floor

    def _generate(self, prompts: list[list[int]], new: int, pad: int):
        res = self.engine.generate(prompts, new, SamplingParams(), pad, ignore_eos=True)
        if any(len(t) != new for t in res.token_ids):
            raise RuntimeError(f"{self.label}: a row stopped before {new} tokens; EOS was meant to be disabled")
        self.peak_rss = [max(a, r["peak_rss_bytes"]) for a, r in zip(self.peak_rss, res.ranks)]
        self.weight_bytes = res.ranks[0].get("weight_bytes", self.weight_bytes)
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
        else:
            self.tokens_b8_row0 = res.token_ids[0]
        return res.decode_tokens / res.decode_s, extra

    def prefill(self, prompt: list[int], pad: int) -> tuple[float, dict]:
        res, _ = self._generate([prompt], 1, pad)
        return res.prompt_tokens / res.prefill_s, {"prefill_s": res.prefill_s}

    def stop(self) -> None:
        self.engine.close()


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
                paired = (system.label, metric) == PAIRED  # the round's floor (float32, tp 1)
                own = metric == "decode_b1" and system.label in OWN_FLOOR  # the floor of this very sample: the
                before = _bandwidth(gate, r, rounds, say, "before") if own else None  # VM's memory bandwidth moves
                share, (value, extra) = gate.measure(lambda: run_metric(system, metric, work, new))  # by seconds
                say(f"round {r + 1}/{rounds}  {system.label:<22} {metric:<11} {value:8.1f} tok/s  "
                    f"(other processes: {share:.0%} of the cores; waited/discarded {gate.waited_s:.0f} s so far)")
                if own:
                    after = _bandwidth(gate, r, rounds, say, "after")
                    extra["read"] = (before["read"] + after["read"]) / 2
                if paired:
                    bandwidth.append({k: (before[k] + after[k]) / 2 for k in after} |
                                     {"spread": (before["read"], after["read"])})
                samples.setdefault((system.label, metric), []).append(Sample(value, share, extra))
        if len(bandwidth) == r:  # no tp1 batch-1 sample this round
            bandwidth.append(_bandwidth(gate, r, rounds, say))
    return samples, bandwidth


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


DEFAULT_PEERS = "transformers,llamacpp"
FULL = ("decode_b1", "decode_b8", "prefill")
B1_PREFILL = ("decode_b1", "prefill")


def make_systems(folder: Path, peers: str, cores: int, say) -> tuple[list, object]:
    """shardlm in float32 (tp 1, 2), bfloat16, int8 and int4 (each with the int8 embedding, as llama.cpp's Q8_0
    and the bundled Q4_1 file hold theirs), and the peers asked for: transformers float32 / bfloat16 and
    llama.cpp f32 / f16 / Q8_0 / Q4_1. Returns (systems, the llama.cpp peer process or None)."""
    wanted = {p.strip() for p in peers.split(",") if p.strip()}
    unknown = wanted - {"transformers", "llamacpp"}
    if unknown:
        raise SystemExit(f"--peers {peers}: unknown {', '.join(sorted(unknown))}; use transformers, llamacpp")
    systems = [ShardlmSystem("shardlm tp1", folder, 1, "float32", FULL),
               ShardlmSystem("shardlm tp2", folder, 2, "float32", FULL),
               ShardlmSystem("shardlm tp1 bf16", folder, 1, "bfloat16", B1_PREFILL),
               ShardlmSystem("shardlm tp1 int8", folder, 1, "float32", FULL, "int8"),
               ShardlmSystem("shardlm tp1 int4", folder, 1, "float32", FULL, "int4")]
    if "transformers" in wanted:
        systems += [TransformersSystem("transformers", folder, torch.float32, FULL),
                    TransformersSystem("transformers bf16", folder, torch.bfloat16, B1_PREFILL)]
    peer = None
    if "llamacpp" in wanted:
        why = llamacpp.available()
        if why:
            say(f"llama.cpp skipped: {why}")
        else:
            files = llamacpp.gguf_files(folder, say)
            peer = llamacpp.Peer()
            systems += [llamacpp.LlamaCppSystem(f"llama.cpp {kind}", peer, files[kind], kind, metrics, cores)
                        for kind, metrics in (("f32", FULL), ("f16", B1_PREFILL), ("q8_0", B1_PREFILL),
                                              ("q4_1", B1_PREFILL))]
    return systems, peer


def peer_info(peer, systems) -> dict[str, str]:
    """The llama.cpp build and its files, for the machine line."""
    if peer is None:
        return {}
    files = ", ".join(f"{sy.dtype} {sy.file_bytes / 1e6:.1f} MB" for sy in systems if hasattr(sy, "file_bytes"))
    return {"llamacpp": f"llama-cpp-python {peer.info['version']} (built here, GGML_NATIVE; {peer.info['system']}); "
                        f"GGUF files: {files}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 round, 32 new tokens, RESULTS.md untouched")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, --quick 1)")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per decode run (default 128, --quick 32)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md as it is")
    ap.add_argument("--peers", default=DEFAULT_PEERS, help="comma list of transformers, llamacpp (default both; "
                    "llama.cpp is skipped with a note when scripts/setup_llamacpp.sh has not installed it)")
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
    tok = load_tokenizer(folder)
    work = make_workload(tok, pad_id(tok))
    systems, peer = make_systems(folder, opts.peers, cores, say)
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
        if peer is not None:
            peer.close()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # headers only; a tied embedding is stored once
        params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    wbytes = {"float32": params * 4, "bfloat16": params * 2}
    foreign = [x.foreign for ss in samples.values() for x in ss]
    cfg = {
        "systems": systems, "samples": samples, "bandwidth": bandwidth, "rounds": rounds, "new": new,
        "wbytes": wbytes, "params": params, "threads": cores, "info": machine_info() | peer_info(peer, systems),
        "command": "python bench/decode.py" + (" --quick" if opts.quick else "")
        + (f" --peers {opts.peers}" if opts.peers != DEFAULT_PEERS else ""),
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "uptime_start": uptime_start, "uptime_end": uptime(),
        "foreign_median": statistics.median(foreign), "foreign_max": max(foreign), "waited_s": gate.waited_s,
        "retried": gate.retried,
        "summary": summarize(systems, samples, bandwidth, wbytes), "notes": collect_notes(systems, samples),
    }
    print_tables(cfg)
    if opts.quick or opts.no_write:
        say(f"{RESULTS.name} not written ({'--quick' if opts.quick else '--no-write'})")
    else:
        write_section(markdown(cfg), HEADING)
        say(f"wrote the section '{HEADING}' of {RESULTS}")


if __name__ == "__main__":
    sys.exit(main())
