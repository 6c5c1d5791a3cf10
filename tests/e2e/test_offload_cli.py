"""`--memory-budget` as a user runs it: same tokens, memory within the budget, per-rank figures, bad input."""

from __future__ import annotations

import json

import pytest
import yaml

from test_cli import run_cli

MiB = 2**20
OVERHEAD = 64 * MiB
"""What a rank may hold beyond its budget: KV cache, activations, allocator slack (stated in the README)."""


def _generate(*flags: str) -> dict:
    res = run_cli("generate", "The capital of France is", "--max-new-tokens", "8", "--json", *flags)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("flags,budget_mib", [(("--memory-budget", "250MB"), 250),
                                              (("--memory-budget", "150MB", "--tp", "2", "--no-prefetch"), 150),
                                              (("--memory-budget", "130MB", "--quantization", "int8"), 130),
                                              (("--memory-budget", "40MB", "--pp", "2"), 40)])
def test_streamed_runs_give_the_in_memory_tokens_within_the_budget(flags, budget_mib, tmp_path):
    # 40 MB at pp 2 is below each stage's embedding or tied head (108 MiB): those are used in place
    # from the mapped file, a block of rows at a time
    quant = ("--quantization", "int8") if "int8" in flags else ()
    plain = _generate(*quant, *(("--pp", "2") if "--pp" in flags else ()))
    ours = _generate(*flags, "--offload-dir", str(tmp_path))
    assert ours["token_ids"] == plain["token_ids"]
    for r in ours["ranks"]:
        assert r["streamed_layers"], r
        assert r["resident_bytes"] <= budget_mib * MiB
        grown = r["peak_rss_bytes"] - r["rss_before_load_bytes"]
        assert grown <= budget_mib * MiB + OVERHEAD, (grown / MiB, r)
        assert r["streamed_bytes_per_token"] >= r["streamed_bytes_per_step"] * 0.9
        if "--no-prefetch" in flags:
            assert r["prefetch_hit_rate"] == 0
        else:
            assert 0 <= r["prefetch_hit_rate"] <= 1
    assert not list(tmp_path.iterdir()), "scratch files left behind"


@pytest.mark.parametrize("args,expect", [
    (["--memory-budget", "20MB"], "needs at least"),
    (["--memory-budget", "lots"], "--memory-budget"),
    (["--offload-dir", "/tmp"], "only apply with --memory-budget"),
    (["--memory-budget", "250MB", "--offload-dir", "/proc/shardlm"], "is not writable"),
])
def test_bad_offload_input_gets_one_line(args, expect):
    res = run_cli("generate", "x", "--max-new-tokens", "2", *args)
    assert res.returncode == 2 and expect in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_a_manifest_that_streams_layers_runs_them_from_disk(tmp_path):
    manifest = tmp_path / "m.yaml"
    res = run_cli("plan", "smollm2-135m", "--devices", "1xcpu-700MB", "--offload", "--dtype", "float32",
                  "--quantization", "none", "--max-seq-len", "512", "-o", str(manifest))
    assert res.returncode == 0, res.stderr
    text = manifest.read_text()
    assert "tier: disk" in text
    counts = yaml.safe_load(text)["offload"]["layers"]
    out = _generate("--manifest", str(manifest))
    assert out["token_ids"] == _generate()["token_ids"]
    assert out["ranks"][0]["streamed_layers"] == list(range(30 - counts[0], 30))
    gpu_tier = tmp_path / "cpu_tier.yaml"
    gpu_tier.write_text(text.replace("tier: disk", "tier: cpu"))
    res = run_cli("generate", "x", "--manifest", str(gpu_tier))
    assert res.returncode == 2 and "offload.tier: cpu" in res.stderr, res.stderr
