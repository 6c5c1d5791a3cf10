"""`shardlm validate` on a manifest that does not match its model or its devices: exit 2, one line, no traceback."""

from __future__ import annotations

import pytest

from test_cli import run_cli


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    """The text of a tp-2 manifest for the bundled model on two CPU workers, planned once."""
    path = tmp_path_factory.mktemp("m") / "m.yaml"
    r = run_cli("plan", "smollm2-135m", "--devices", "2xcpu-2GB", "--tp", "2", "-o", str(path))
    assert r.returncode == 0, r.stderr
    return path.read_text()


@pytest.mark.parametrize("old, new, expected", [
    # without `cluster` the plan is for this machine ("local"), which has no device 0:4095
    ("cluster: 2xcpu-2GB\n", "", "stages[0].devices[0][1]: device '0:4095' is not in cluster local"),
    ('"0:1"', '"0:99"', "stages[0].devices[0][1]: device '0:99' is not in cluster 2xcpu-2GB (2 x cpu-2GB: 0:0..0:1)"),
    ("name: smollm2-135m", "name: llama-3.1-8b",
     "model.layers: the manifest's stages cover 30 layers but llama-3.1-8b has 32"),
    ("parameters: 134515008", "parameters: 8030261248",
     "model.parameters: the manifest is for 8030261248 parameters but smollm2-135m has 134515008"),
    ("max_seq_len: 4096", "max_seq_len: 0400",
     "kv_cache.max_seq_len: expected an integer >= 1, got 0400 (YAML 1.1 would read that as 256"),
], ids=["no-cluster", "address", "model-name", "parameters", "yaml-1.1"])
def test_validate_refuses_in_one_line(tmp_path, manifest, old, new, expected):
    assert old in manifest
    path = tmp_path / "m.yaml"
    text = manifest.replace(old, new, 1)
    path.write_text(text.replace('"0:1"', '"0:4095"') if "cluster:" not in text else text)
    r = run_cli("validate", str(path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert expected in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
