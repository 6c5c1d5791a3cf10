"""`shardlm generate --pp` as a user runs it: parity, stage ranges from flags and manifests, bad input.

A killed stage is tested with a killed tp rank in test_cli.py."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import hf_model
from refs import hf_logits_and_tokens
from test_cli import run_cli


def test_uneven_stages_with_micro_batches_match_transformers(bundled_dir):
    from transformers import AutoTokenizer

    prompts = ["The capital of France is", "Write a haiku about the sea. The first line:", "2+2="]
    res = run_cli("-v", "generate", *prompts, "--pp", "2", "--layers", "20,10", "--micro-batches", "2",
                  "--max-new-tokens", "10", "--json")
    assert res.returncode == 0, res.stderr
    # one log format everywhere, and each rank says who it is in every line
    lines = [ln for ln in res.stderr.splitlines() if re.match(r"\d\d:\d\d:\d\d\.\d{3} \[", ln)]
    for who in ("[driver]", "[rank 0 stage 0 tp 0]", "[rank 1 stage 1 tp 0]"):
        assert any(who in ln for ln in lines), (who, res.stderr[-3000:])
    assert any("[rank 1 stage 1 tp 0] INFO shardlm.runtime.build: built layers 20-29" in ln for ln in lines)
    out = json.loads(res.stdout)
    assert out["pp"] == 2 and out["stages"] == [[0, 20], [20, 30]] and out["micro_batches"] == 2
    assert [(r["rank"], r["stage"]) for r in out["ranks"]] == [(0, 0), (1, 1)]
    # hidden states flow stage 0 -> stage 1; sampled tokens go back through the driver, which schedules each step
    assert out["ranks"][0]["comms"]["send"]["calls"] > 0 and out["ranks"][1]["comms"]["recv"]["calls"] > 0
    ids = [AutoTokenizer.from_pretrained(bundled_dir)(p)["input_ids"] for p in prompts]
    _, ref = hf_logits_and_tokens(hf_model(bundled_dir), ids, 10)
    for ours, theirs in zip(out["token_ids"], ref):
        cut = theirs.index(2) + 1 if 2 in theirs else len(theirs)
        assert ours == theirs[:cut]


def test_manifest_stage_ranges_are_honoured(tmp_path):
    manifest = tmp_path / "m.yaml"
    res = run_cli("plan", "smollm2-135m", "--devices", "2xcpu-4GB", "--pp", "2", "-o", str(manifest))
    assert res.returncode == 0, res.stderr
    stages = [s["layers"] for s in yaml.safe_load(manifest.read_text())["stages"]]
    res = run_cli("generate", "The capital of France is", "--manifest", str(manifest), "--max-new-tokens", "4",
                  "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["pp"] == 2 and out["stages"] == stages and "Paris" in out["text"][0]
    bad = run_cli("generate", "x", "--manifest", str(manifest), "--pp", "3")
    assert bad.returncode == 2 and "--pp 3 cannot be combined with --manifest" in " ".join(bad.stderr.split())


@pytest.mark.parametrize("args,expect", [
    (["--pp", "31"], "use --pp 30"),
    (["--pp", "2", "--layers", "20,20"], "sums to 40"),
    (["--pp", "2", "--layers", "10,10,10"], "gives 3 stage(s) but --pp is 2"),
    (["--pp", "2", "--layers", "20,x"], "comma-separated"),
    (["--pp", "2", "--micro-batches", "3"], "use --micro-batches 1"),
    (["--micro-batches", "2"], "only applies to pipeline parallelism"),
])
def test_bad_stage_flags_are_one_line_exit_2(args, expect):
    res = run_cli("generate", "x", *args)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert expect in " ".join(res.stderr.split()), res.stderr
    assert "Traceback" not in res.stderr
