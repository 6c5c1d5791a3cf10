"""Checkpoint commands as a user runs them: SIGKILL at random moments, verify, generate from per-rank files."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shardlm.checkpoint.output import stale_siblings
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
    """True once process `pid` is building its output (in `.OUT.shardlm-tmp-PID-*` beside `out`)."""
    prefix = f".{out.name}.shardlm-tmp-{pid}-"
    return any(p.name.startswith(prefix) for p in out.parent.iterdir())


def _kill_during(cmd: list[str], out: Path, window_s: float, rng: random.Random) -> None:
    """Start `cmd`, wait until it writes its output, then SIGKILL it at a random moment within `window_s`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not _writing(out, proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0, window_s))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _assert_none_or_complete(out: Path) -> str:
    """No output folder at all, or a complete checkpoint: never a partial one."""
    if not out.exists():
        return "none"
    rep = verify(out)
    assert rep.ok, rep.problems
    return "complete"


def _trials(cmds: dict[str, list[str]], out: Path, window: float, n: int, rng: random.Random) -> list[str]:
    """`n` SIGKILL trials, alternating commands; odd trials replace a complete output with --overwrite."""
    outcomes = []
    names = sorted(cmds)
    for i in range(n):
        fresh = i % 2 == 0
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        elif not out.exists():
            subprocess.run(cmds[names[i % len(names)]] + ["-o", str(out), "--json"], capture_output=True, timeout=180)
        cmd = cmds[names[(i // 2) % len(names)]] + ["-o", str(out), "--json"] + ([] if fresh else ["--overwrite"])
        _kill_during(cmd, out, 0.0 if i == 0 else window, rng)  # the first kill lands as the build starts
        outcome = _assert_none_or_complete(out)
        assert fresh or outcome == "complete", "--overwrite lost the old checkpoint"
        outcomes.append(outcome)
    return outcomes


def _window(cmd: list[str], out: Path) -> float:
    res = subprocess.run(cmd + ["-o", str(out), "--json"], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["seconds"] + 0.3


def test_sigkill_during_shard_and_reshard_leaves_nothing_or_a_complete_checkpoint(medium, tmp_path):
    rng = random.Random(1234)
    tp2 = _manifest(tmp_path, "tp2", "2xcpu-4GB", 2, 1, model=str(medium))
    tp3 = _manifest(tmp_path, "tp3", "3xcpu-4GB", 3, 1, model=str(medium))
    full = tmp_path / "full"
    window = _window(SHARDLM + ["shard", str(medium), "--manifest", str(tp2), "--max-shard-size", "4MB"], full)
    cmds = {"shard": SHARDLM + ["shard", str(medium), "--manifest", str(tp3), "--max-shard-size", "4MB"],
            "reshard": SHARDLM + ["reshard", str(full), "--manifest", str(tp3), "--max-shard-size", "4MB"]}
    out = tmp_path / "out"
    outcomes = _trials(cmds, out, window, 4, rng)  # bench/checkpoint_faults.py runs many more
    assert outcomes[0] == "none", outcomes  # a kill mid-write leaves no folder (the test is not vacuous)
    shutil.rmtree(out, ignore_errors=True)
    res = subprocess.run(cmds["reshard"] + ["-o", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr  # no --overwrite needed after the kills
    assert verify(out).ok
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name], "temporary files left behind"
    assert not stale_siblings(out), "a killed run's build folder was not swept"


def test_sigkill_during_consolidate_and_convert_leaves_nothing_or_a_complete_checkpoint(medium, tmp_path):
    rng = random.Random(99)
    tp2 = _manifest(tmp_path, "tp2", "2xcpu-4GB", 2, 1, model=str(medium))
    full = tmp_path / "full"
    res = subprocess.run(SHARDLM + ["shard", str(medium), "--manifest", str(tp2), "-o", str(full)],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    cmds = {"consolidate": SHARDLM + ["consolidate", str(full), "--max-shard-size", "4MB"],
            "convert": SHARDLM + ["convert", str(medium), "--max-shard-size", "4MB"]}
    window = _window(cmds["convert"], tmp_path / "probe")
    out = tmp_path / "out"
    _trials(cmds, out, window, 2, rng)
    shutil.rmtree(out, ignore_errors=True)
    res = subprocess.run(cmds["consolidate"] + ["-o", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and verify(out).ok and not stale_siblings(out), res.stderr


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
    (["plan", "debug", "--devices", "2xcpu-4GB", "-o", "{tmp}/no/such/x.yaml"], "no/such' does not exist; create it first"),
    (["convert", "smollm2-135m", "-o", "{tmp}/c", "--verify", "quick"], "--verify quick is not a mode"),
])
def test_bad_checkpoint_commands_exit_2(tmp_path, args, expect):
    res = run_cli(*[a.format(tmp=tmp_path) for a in args])
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert expect in " ".join((res.stdout + res.stderr).split())
    assert "Traceback" not in res.stderr


def test_commands_refuse_a_corrupt_checkpoint_by_name_and_write_nothing(tmp_path):
    from shardlm.checkpoint.shard import shard

    hf = write_random_checkpoint({**PRESETS["debug"]}, tmp_path / "hf", seed=2)
    ranks = tmp_path / "ranks"
    shard(hf, ranks, 2, (), 2**20, progress=False)
    data = sorted((ranks / "rank-00001").glob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x10
    data.write_bytes(raw)
    tp1 = _manifest(tmp_path, "tp1", "1xcpu-4GB", 1, 1)
    out = tmp_path / "out"
    for args in (["generate", "x", "--model", str(ranks), "--tp", "2"],
                 ["reshard", str(ranks), "--manifest", str(tp1), "-o", str(out)],
                 ["consolidate", str(ranks), "-o", str(out)]):
        res = run_cli(*args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        text = " ".join(res.stderr.split())
        assert f"{data} does not match the sha256 recorded" in text and "Traceback" not in res.stderr, text
        assert not out.exists() and not stale_siblings(out)
    res = run_cli("verify", str(hf))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no checksums recorded: there is nothing to compare the data against" in " ".join(res.stdout.split())
