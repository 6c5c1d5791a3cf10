"""`shardlm inspect / plan / validate` end to end: outputs, manifest round trip, bad input."""

from __future__ import annotations

import json

import pytest
import yaml

from test_cli import run_cli


def test_inspect_json_counts_parameters_and_kv():
    r = run_cli("inspect", "llama-3.1-8b", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert abs(info["parameters"] / 1e9 - 8.03) < 0.01
    assert info["kv_cache_bytes_per_token"]["bfloat16"] == 2 * 32 * 8 * 128 * 2
    assert set(info["bytes"]) == {"float32", "bfloat16", "float16", "int8", "int4"}


def test_plan_writes_manifest_figure_and_json(tmp_path):
    m, fig = tmp_path / "m.yaml", tmp_path / "plan.png"
    r = run_cli("plan", "llama-3.1-70b", "--devices", "8xH100-80GB", "--max-batch", "8", "-o", str(m),
                "--figure", str(fig), "--json")
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)["best"]
    assert best["parallelism"] == {"tensor": 8, "pipeline": 1, "data": 1}
    assert set(best["ranks"][0]["memory"]) >= {"weights", "kv_cache", "activations", "overhead", "total"}
    assert best["ranks"][0]["capacity"] > best["ranks"][0]["memory"]["total"]
    assert fig.read_bytes()[:4] == b"\x89PNG"
    v = run_cli("validate", str(m))
    assert v.returncode == 0 and "ok:" in v.stdout, v.stdout + v.stderr


def test_validate_rejects_an_edited_manifest_over_budget(tmp_path):
    m = tmp_path / "m.yaml"
    assert run_cli("plan", "llama-3.1-8b", "--devices", "2xRTX4090-24GB", "--pp", "2", "--max-batch", "8",
                   "--max-seq-len", "8192", "-o", str(m)).returncode == 0
    doc = yaml.safe_load(m.read_text())
    doc["stages"][0]["layers"], doc["stages"][1]["layers"] = [0, 31], [31, 32]
    doc.pop("predictions")
    m.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = run_cli("validate", str(m))
    assert r.returncode == 2
    assert "rank 0" in r.stderr and "GiB" in r.stderr and "out of balance" in r.stderr


@pytest.mark.parametrize("args,expect", [
    (("inspect", "llama-3.1-8"), "did you mean llama-3.1-8b"),
    (("plan", "llama-3.1-8b", "--devices", "8xH1OO"), "H100"),
    (("plan", "llama-3.1-8b", "--devices", "2xcpu"), "2xcpu-4GB"),
    (("plan", "llama-3.1-405b", "--devices", "1xRTX4090-24GB"), "fits nowhere"),
    (("plan", "llama-3.1-8b", "--devices", "1xH100-80GB", "--quantization", "int3"), "--quantization int3"),
    (("plan", "llama-3.1-8b", "--devices", "1xH100-80GB", "--tp", "40"), "--tp 40"),
    (("validate", "/no/such/manifest.yaml"), "manifest.yaml"),
])
def test_bad_input_is_one_line_and_exit_2(args, expect):
    r = run_cli(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert expect in r.stderr and "Traceback" not in r.stderr


def test_validate_names_field_and_line(tmp_path):
    m = tmp_path / "m.yaml"
    assert run_cli("plan", "smollm2-135m", "--devices", "2xcpu-2GB", "-o", str(m)).returncode == 0
    text = m.read_text().replace("parallelism: {tensor: 1", "parallelism: {tensor: two")
    lines = text.splitlines()
    line = next(i for i, s in enumerate(lines, 1) if "tensor: two" in s)
    m.write_text(text)
    r = run_cli("validate", str(m))
    assert r.returncode == 2 and f":{line}:" in r.stderr and "parallelism.tensor" in r.stderr, r.stderr
