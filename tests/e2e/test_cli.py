"""The `shardlm` command as a user runs it: output, JSON, bad input, a killed rank, Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import hf_model
from refs import hf_logits_and_tokens

SHARDLM = [sys.executable, "-m", "shardlm"]


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run `shardlm ARGS...` to completion and capture its output."""
    return subprocess.run(SHARDLM + list(args), capture_output=True, text=True, timeout=timeout)


def test_generate_streams_the_bundled_completion():
    res = run_cli("generate", "The capital of France is", "--max-new-tokens", "3", "--tp", "2")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(" Paris"), res.stdout
    assert "tp=2" in res.stderr and "peak RSS" in res.stderr


def test_batch_prints_every_completion():
    res = run_cli("generate", "The capital of France is", "2+2=", "--max-new-tokens", "3", "--tp", "2")
    assert res.returncode == 0, res.stderr
    assert "[0] The capital of France is" in res.stdout and "[1] 2+2=" in res.stdout and "Paris" in res.stdout


def test_json_batch_matches_transformers_greedy(bundled_dir):
    from transformers import AutoTokenizer

    prompts = ["The capital of France is", "Write a haiku about the sea. The first line:"]
    res = run_cli("generate", *prompts, "--max-new-tokens", "12", "--tp", "3", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert set(out) >= {"text", "token_ids", "timings", "ranks"}
    assert set(out["timings"]) >= {"load_s", "prefill_tokens_per_s", "decode_tokens_per_s"}
    assert [r["rank"] for r in out["ranks"]] == [0, 1, 2]
    assert all(r["peak_rss_bytes"] > 100 * 2**20 for r in out["ranks"])
    ids = [AutoTokenizer.from_pretrained(bundled_dir)(p)["input_ids"] for p in prompts]
    _, ref = hf_logits_and_tokens(hf_model(bundled_dir), ids, 12)
    eos = 2
    for ours, theirs in zip(out["token_ids"], ref):
        cut = theirs.index(eos) + 1 if eos in theirs else len(theirs)
        assert ours == theirs[:cut]


def test_chat_and_sampling_flags_run():
    res = run_cli("generate", "Name a colour.", "--chat", "--temperature", "0.7", "--top-p", "0.9",
                  "--top-k", "40", "--seed", "3", "--max-new-tokens", "6", "--json")
    assert res.returncode == 0, res.stderr
    again = run_cli("generate", "Name a colour.", "--chat", "--temperature", "0.7", "--top-p", "0.9",
                    "--top-k", "40", "--seed", "3", "--max-new-tokens", "6", "--json", "--tp", "2")
    assert json.loads(res.stdout)["token_ids"] == json.loads(again.stdout)["token_ids"]  # same seed, any tp


def _bad_model_dirs(root: Path, bundled: Path) -> dict[str, Path]:
    dirs = {name: root / name for name in ("empty", "gpt2", "huge", "missing")}
    for d in dirs.values():
        d.mkdir()
    (dirs["gpt2"] / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    huge = json.loads((bundled / "config.json").read_text())
    huge.update(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, head_dim=128)
    (dirs["huge"] / "config.json").write_text(json.dumps(huge))
    for f in bundled.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.startswith("."):
            shutil.copy(f, dirs["missing"])
    return dirs


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory, bundled_dir):
    return _bad_model_dirs(tmp_path_factory.mktemp("bad"), bundled_dir)


@pytest.mark.parametrize("args,expect", [
    (["--model", "/no/such/folder", "x"], "does not exist"),
    (["--model", "{empty}", "x"], "no config.json"),
    (["--model", "{gpt2}", "x"], "supported architectures: LlamaForCausalLM"),
    (["--model", "{huge}", "x"], "GiB is available"),
    (["--model", "{missing}", "x"], "holds no safetensors weights"),
    (["--tp", "10", "x"], "use --tp 9"),
    (["--temperature", "-1", "x"], "'--temperature': '-1' is outside [0, 100]"),
    (["--top-p", "1.5", "x"], "'--top-p': '1.5' is outside (0, 1]"),
    (["--top-k", "-1", "x"], "'--top-k': '-1' is outside 0..10000000"),
    (["--max-new-tokens", "0", "x"], "'--max-new-tokens': '0' is outside 1..10000000"),
    (["--dtype", "float16", "x"], "--dtype float16 is not supported"),
    (["--device", "tpu", "x"], "--device tpu is not supported; use cpu or cuda"),
    (["--device", "cuda", "--offload-dir", "/tmp", "--memory-budget", "100MB", "x"], "drop --offload-dir"),
    (["   "], "empty prompt"),
    # argv b'caf\xff': Python keeps the byte as U+DCFF
    (["ok", "caf\udcff"], "prompt 2 is not Unicode text: byte 0xFF, which is not UTF-8, at character 3"),
])
def test_bad_input_is_one_line_exit_2(args, expect, bad_dirs):
    args = [a.format(**{k: str(v) for k, v in bad_dirs.items()}) for a in args]
    res = run_cli("generate", *args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert expect in " ".join(res.stderr.split()), res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_cuda_on_a_machine_without_one_is_one_line_exit_2():
    res = run_cli("generate", "x", "--device", "cuda", "--max-new-tokens", "2")
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "torch sees no CUDA device" in res.stderr and "use --device cpu" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    res = run_cli("perplexity", "--device", "cuda")
    assert res.returncode == 2 and "torch sees no CUDA device" in res.stderr and "Traceback" not in res.stderr, \
        res.stderr


def test_truncated_checkpoint_is_named(tmp_path, bundled_dir):
    for f in bundled_dir.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy(f, tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    res = run_cli("generate", "--model", str(tmp_path), "x")
    assert res.returncode == 2 and "model.safetensors" in res.stderr and "truncated" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def _rank_pids(proc: subprocess.Popen, n: int, timeout: float = 90) -> list[int]:
    """The pids of the driver's rank processes, once `n` of them run and the first token appeared."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("shardlm-rank")]
        if len(kids) >= n:
            return [p.pid for p in kids]
        assert proc.poll() is None, f"the run ended early: {proc.communicate()}"
        time.sleep(0.2)
    raise AssertionError(f"ranks did not start within {timeout} s")


_LONG_RUNS: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_long_runs():
    """A long run a failed test left behind is killed (with its ranks), so it does not slow the tests after."""
    yield
    while _LONG_RUNS:
        proc = _LONG_RUNS.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)


def _default_sigint() -> None:
    """Give the run a terminal's Ctrl-C even when these tests run as a background job (`pytest &` in a script
    starts with SIGINT ignored, which its children inherit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_long_run(*layout: str) -> subprocess.Popen:
    """A long generate with `layout` flags (e.g. "--tp", "2"), once it streams its first character."""
    proc = subprocess.Popen(SHARDLM + ["generate", "Tell me a very long story.", *layout,
                                       "--max-new-tokens", "4000", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)
    _LONG_RUNS.append(proc)
    proc.stdout.read(1)  # the first streamed character: every rank is loaded and generating
    return proc


def _assert_all_gone(pids: list[int], within: float = 10) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return
        time.sleep(0.2)
    raise AssertionError(f"orphan rank processes left: {[p for p in pids if psutil.pid_exists(p)]}")


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")])  # a tp rank, or a whole pipeline stage
def test_killed_rank_ends_the_run_with_a_clear_error(layout):
    proc = _start_long_run(*layout)
    pids = _rank_pids(proc, 2)
    os.kill(pids[-1], signal.SIGKILL)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 15
    assert proc.returncode == 1
    assert "died with signal 9" in err, err
    _assert_all_gone(pids)


def test_a_stopped_rank_is_named_within_seconds_and_every_rank_stops():
    """SIGSTOP leaves the process alive but silent: its heartbeat stops, and the driver names it (HANG_S 4 s)."""
    proc = _start_long_run("--tp", "2")
    pids = _rank_pids(proc, 2)
    victim = pids[-1]
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if psutil.pid_exists(victim):
            os.kill(victim, signal.SIGCONT)
    assert time.monotonic() - t0 < 10, "a stopped rank must be found within seconds, not the 300 s gloo timeout"
    assert proc.returncode == 1 and "stopped responding" in err and f"pid {victim}" in err, err
    _assert_all_gone(pids)


def test_a_rank_killed_while_loading_is_named_as_dead():
    proc = subprocess.Popen(SHARDLM + ["generate", "x", "--tp", "2", "--max-new-tokens", "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = _rank_pids(proc, 2)
    os.kill(pids[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "died with signal 9" in err and f"pid {pids[-1]}" in err, err
    assert "Traceback" not in err
    _assert_all_gone(pids)


def test_ctrl_c_stops_every_rank():
    proc = _start_long_run("--tp", "2")
    pids = _rank_pids(proc, 2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the foreground group on Ctrl-C
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    _assert_all_gone(pids)


@pytest.mark.parametrize("after_s", [0.2, 1.0])  # importing the command line; the fork server importing torch
def test_ctrl_c_while_starting_is_one_line_and_leaves_nothing(after_s):
    proc = subprocess.Popen(SHARDLM + ["generate", "x", "--tp", "2", "--max-new-tokens", "4"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    _assert_all_gone(_group(proc.pid))  # the fork server and any rank (they share the driver's process group)


def _group(pgid: int) -> list[int]:
    """The pids of the processes in process group `pgid`."""
    pids = []
    for p in psutil.pids():
        try:
            if os.getpgid(p) == pgid:
                pids.append(p)
        except ProcessLookupError:
            pass
    return pids


def test_killed_driver_leaves_no_orphan_rank():
    """Nor the fork server the ranks forked from, nor multiprocessing's resource tracker."""
    proc = _start_long_run("--tp", "2")
    _rank_pids(proc, 2)
    everyone = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(everyone) >= 3, everyone  # the ranks, the fork server
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    _assert_all_gone(everyone)
