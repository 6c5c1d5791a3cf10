"""Shared by the decode benchmarks: CPU accounting on a shared host, the quiet gate, bandwidth, the machine, and
the RESULTS.md section writer (bench/decode.py, bench/decode_vs_commit.py and the checkpoint benchmarks use them)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from shardlm.atomic import atomic_file

QUIET_CPU = 0.10  # other processes may use at most this share of the cores before a sample starts
RETRY_CPU = 0.20  # a sample during which they used more is taken again ...
TRIES = 3  # ... up to this many times in all; the last try is kept either way
QUIET_WAIT_S = 45.0  # longest wait for quiet before one try
QUIET_BUDGET_S = 300.0  # longest total time spent waiting and on discarded tries in one run
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


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


@dataclass
class Sample:
    value: float  # tokens per second
    foreign: float  # share of the cores other processes used meanwhile
    extra: dict = field(default_factory=dict)


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


def rank_env(**extra: str) -> dict[str, str]:
    """The environment a rank process of this tree starts with, plus `extra`: glibc's malloc on transparent huge pages
    (settings.huge_page_children, as engine/ranks.py starts a rank whose weights stay in memory) unless
    SHARDLM_HUGE_PAGES=0. A bench child that builds a rank in-process takes it, so its weights sit on the pages a
    rank's do: on 4 KiB pages the bundled model's int8 batch-1 step took 4.08-4.16 ms where a rank's took 3.30-3.71
    (alternating runs, 2026-11-30)."""
    from shardlm.settings import Settings, huge_page_children

    with huge_page_children(Settings.from_env().huge_pages):
        env = dict(os.environ)
    return {**env, **extra}


def format_args(doc: str, formats: str, rounds: int, child) -> argparse.Namespace | None:
    """The arguments of a bench that runs a process per format (--formats, --rounds, --no-write); None in such a
    process (--child FMT), after it printed child(FMT, rounds) as JSON."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--formats", default=formats)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rounds)))
        return None
    return args


def format_child(script: str, fmt: str, rounds: int) -> dict:
    """`script --child FMT --rounds N` in a process started as a rank of this tree starts (rank_env): the JSON of
    its last line; SystemExit with its stderr's tail if it failed."""
    res = subprocess.run([sys.executable, script, "--child", fmt, "--rounds", str(rounds)], capture_output=True,
                         text=True, timeout=900, env=rank_env())
    if res.returncode != 0:
        raise SystemExit(f"{fmt} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def record(heading: str, command: str, started: str, what: str, rows: list[str], no_write: bool) -> None:
    """Print a bench's section (its heading, the command, date and machine, `what` the numbers are, the table rows)
    and write it to RESULTS.md unless `no_write`."""
    info = machine_info()
    text = "\n".join([heading, "", f"Command: `{command}`. Date: {started}. Machine: {info['cpu']}, {info['cores']} "
                      f"cores, {info['ram']}; torch {info['torch']}. {what}", "", *rows])
    print(text)
    if not no_write:
        write_section(text, heading)


def cpu_field(name: str, default: str = "?") -> str:
    """The first /proc/cpuinfo line named `name`, its value ("?" where there is none)."""
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.split(":", 1)[0].strip() == name), default)


def machine_info() -> dict[str, str]:
    """The machine a run took its numbers on. The CPU's family and model go with its name: this VM has been lent on
    AMD Zen 4 (family 25, 512-bit vector operations in two halves) and Zen 5 (family 26, full width, with
    avx512_vp2intersect) hosts under the one name "AMD EPYC", and the integer kernels run at different rates on each."""
    model, flags = cpu_field("model name"), cpu_field("flags", "").split()
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vp2intersect", "amx_bf16") if f in flags)
    kind = f"family {cpu_field('cpu family')} model {cpu_field('model')}"
    import transformers

    return {
        "cores": f"{os.cpu_count()} (nproc {len(os.sched_getaffinity(0))})",
        "cpu": f"{model} ({kind}; {isa})",
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


def med(samples: list[Sample] | None) -> float | None:
    return statistics.median(s.value for s in samples) if samples else None


def cell(samples: list[Sample] | None) -> str:
    if not samples:
        return "-"
    vals = [s.value for s in samples]
    m = statistics.median(vals)
    return f"{m:.1f}" if len(vals) == 1 else f"{m:.1f} ({min(vals):.1f}-{max(vals):.1f})"


def fmt_ratio(value: float | None, unit: str) -> str:
    """A ratio as a percentage or a multiple; "-" when it was not measured."""
    if value is None:
        return "-"
    return f"{value:.0%}" if unit == "%" else f"{value:.2f}x"


def write_section(text: str, heading: str) -> None:
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


