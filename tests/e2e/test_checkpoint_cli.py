"""Checkpoint commands as a user runs them: SIGKILL at random moments, verify, generate from per-rank files."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shardlm.checkpoint.sharded import INFO_NAME
from shardlm.checkpoint.verify import verify
from shardlm.models.presets import PRESETS
from shardlm.models.random import write_random_checkpoint
from test_cli import SHARDLM, run_cli

# ~180 MB float32: big enough that a shard run spends a second or more writing
MEDIUM = {**PRESETS["debug"], "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 10,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 16000}


def _manifest(tmp: Path, name: str, devices: str, tp: int, pp: int, model: str = "debug") -> Path:
    path = tmp / f"{name}.yaml"
    res = run_cli("plan", model, "--devices", devices, "--tp", str(tp), "--pp", str(pp), "--dtype", "float32",
                  "-o", str(path))
    assert res.returncode == 0, res.stderr
    return path


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    return write_random_checkpoint(MEDIUM, tmp_path_factory.mktemp("medium") / "model", seed=1)


def _writing(out: Path, pid: int) -> bool:
    """True once process `pid` has a temporary file in `out` (it names them .NAME.tmp-PID).

    os.walk skips folders that vanish mid-scan: with --overwrite the process is removing the
    previous run's files while we look.
    """
    suffix = f".tmp-{pid}"
    return any(name.endswith(suffix) for _, _, names in os.walk(out) for name in names)


def _kill_during(cmd: list[str], out: Path, window_s: float, rng: random.Random) -> None:
    """Start `cmd`, wait until it writes into `out`, then SIGKILL it at a random moment within `window_s`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not _writing(out, proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0, window_s))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _assert_none_or_complete(out: Path) -> str:
    if (out / INFO_NAME).is_file():
        rep = verify(out)
        assert rep.ok, rep.problems
        return "complete"
    rep = verify(out)
    assert not rep.ok  # nothing there loads: no shardlm.json, no checkpoint
    return "none"


def test_sigkill_during_shard_and_reshard_leaves_nothing_or_a_complete_checkpoint(medium, tmp_path):
    rng = random.Random(1234)
    tp2 = _manifest(tmp_path, "tp2", "2xcpu-4GB", 2, 1)
    tp3 = _manifest(tmp_path, "tp3", "3xcpu-4GB", 3, 1)
    full = tmp_path / "full"
    res = subprocess.run(SHARDLM + ["shard", str(medium), "--manifest", str(tp2), "-o", str(full),
                                    "--max-shard-size", "4MB", "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    window = json.loads(res.stdout)["seconds"] + 0.3
    outcomes = []
    for i in range(24):
        out = tmp_path / "out"
        if i % 2 == 0:
            cmd = SHARDLM + ["shard", str(medium), "--manifest", str(tp3)]
        else:
            cmd = SHARDLM + ["reshard", str(full), "--manifest", str(tp3)]
        cmd += ["-o", str(out), "--max-shard-size", "4MB", "--overwrite", "--json"]
        _kill_during(cmd, out, window, rng)
        outcomes.append(_assert_none_or_complete(out))
    assert outcomes.count("none") >= 12, outcomes  # most kills land mid-write
    res = subprocess.run(SHARDLM + ["reshard", str(full), "--manifest", str(tp3), "-o", str(tmp_path / "out"),
                                    "--max-shard-size", "4MB", "--overwrite"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert verify(tmp_path / "out").ok
    assert not [p for p in (tmp_path / "out").rglob("*") if ".tmp-" in p.name], "temporary files left behind"


def test_generate_from_per_rank_files_matches_slicing(tmp_path):
    manifest = _manifest(tmp_path, "pp2", "2xcpu-4GB", 1, 2, model="smollm2-135m")
    res = run_cli("shard", "smollm2-135m", "--manifest", str(manifest), "-o", str(tmp_path / "ranks"))
    assert res.returncode == 0, res.stderr
    recorded = json.loads((tmp_path / "ranks" / INFO_NAME).read_text())
    assert recorded["plan"]["parallelism"]["pipeline"] == 2 and recorded["layout"]["pp"] == 2
    res = run_cli("verify", str(tmp_path / "ranks"))
    assert res.returncode == 0 and "ok:" in res.stdout, res.stdout + res.stderr
    args = ["generate", "The capital of France is", "--manifest", str(manifest), "--max-new-tokens", "6", "--json"]
    ours = run_cli(*args, "--model", str(tmp_path / "ranks"))
    plain = run_cli(*args)
    assert ours.returncode == 0 and plain.returncode == 0, ours.stderr + plain.stderr
    assert json.loads(ours.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    wrong = run_cli("generate", "x", "--model", str(tmp_path / "ranks"), "--tp", "2")
    assert wrong.returncode == 2 and "shardlm reshard" in wrong.stderr
    # without --manifest or layout flags, the files' recorded plan runs (its layout, dtype, quantization)
    recorded = run_cli("generate", "The capital of France is", "--model", str(tmp_path / "ranks"),
                       "--max-new-tokens", "6", "--json")
    assert recorded.returncode == 0, recorded.stderr
    out = json.loads(recorded.stdout)
    assert (out["pp"], out["tp"], out["dtype"]) == (2, 1, "float32") and out["token_ids"] == json.loads(ours.stdout)["token_ids"]


@pytest.mark.parametrize("args,expect", [
    (["verify", "/no/such/folder"], "'/no/such/folder' does not exist; give an existing folder"),
    (["shard", "smollm2-135m", "--manifest", "/no/such.yaml", "-o", "/tmp/x"], "no/such.yaml"),
    (["convert", "smollm2-135m", "-o", "{tmp}/c", "--max-shard-size", "12XB"], "--max-shard-size"),
    (["convert", "smollm2-135m", "-o", "{tmp}/c", "--dtype", "int3"], "--dtype int3 is not supported"),
    (["consolidate", "{tmp}", "-o", "{tmp}/c"], "no per-rank files"),
])
def test_bad_checkpoint_commands_exit_2(tmp_path, args, expect):
    res = run_cli(*[a.format(tmp=tmp_path) for a in args])
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert expect in " ".join((res.stdout + res.stderr).split())
    assert "Traceback" not in res.stderr
