"""`--quantization` as a user runs it: the same tokens at any layout, smaller ranks, manifests, perplexity."""

from __future__ import annotations

import functools
import json

import pytest

from test_cli import run_cli

PROMPTS = ["The capital of France is", "Write a haiku about the sea. The first line:"]


@functools.cache
def _generate(*flags: str) -> dict:
    """A `generate --json` run's result, run once per set of flags in the session (suite time: the one-rank int4 run
    is compared in two tests). Callers do not change it."""
    res = run_cli("generate", *PROMPTS, "--max-new-tokens", "8", "--json", *flags)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def plain():
    """The float32 run the quantized ones are compared with (one for the module, where each case had run its own)."""
    return _generate()


@pytest.mark.parametrize("kind,layouts", [("int8", [("--tp", "2")]), ("int4", [("--tp", "3"), ("--pp", "2")])])
def test_quantized_tokens_do_not_depend_on_the_layout(kind, layouts, plain):
    one = _generate("--quantization", kind)
    assert one["quantization"] == kind
    for flags in layouts:
        other = _generate("--quantization", kind, *flags)
        assert other["token_ids"] == one["token_ids"], flags
        if flags[0] == "--tp":  # a request's traffic only: 2 all-reduces per layer + 1 per forward, none
            calls = other["ranks"][0]["comms"]["all_reduce"]["calls"]  # from quantizing at load
            assert calls % (2 * 30 + 1) == 0, calls
    ratio = one["ranks"][0]["weight_bytes"] / plain["ranks"][0]["weight_bytes"]
    # the tied 113 MB embedding/head stays float32; the linear layers shrink 4x (int8) or ~7x (int4)
    assert ratio < (0.45 if kind == "int8" else 0.38), ratio


def test_manifest_quantization_runs_and_flags_must_agree(tmp_path):
    manifest = tmp_path / "m.yaml"
    res = run_cli("plan", "smollm2-135m", "--devices", "2xcpu-4GB", "--tp", "2", "--dtype", "float32",
                  "--quantization", "int8", "-o", str(manifest))
    assert res.returncode == 0, res.stderr
    out = _generate("--manifest", str(manifest))
    assert out["quantization"] == "int8" and out["tp"] == 2
    clash = run_cli("generate", "x", "--manifest", str(manifest), "--quantization", "int4")
    assert clash.returncode == 2 and "--quantization int4 cannot be combined with --manifest" in \
        " ".join(clash.stderr.split())


@pytest.mark.parametrize("args,expect", [
    (["generate", "x", "--quantization", "int3"], "use none, int8 or int4"),
    (["perplexity", "--quantization", "int8,q2"], "comma-separated list of none, int8, int4"),
    (["perplexity", "--text", "/no/such.txt"], "/no/such.txt"),
    (["perplexity", "--window", "1"], "'--window': '1' is outside 2..10000000"),
])
def test_bad_quantization_input_gets_one_line(args, expect):
    res = run_cli(*args)
    assert res.returncode == 2 and expect in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_perplexity_of_each_format_stays_close_to_float32():
    rows = {}
    for dtype, quants in (("float32", "none,int8,int4"), ("bfloat16", "none,int4")):  # all six: RESULTS.md
        res = run_cli("perplexity", "--dtype", dtype, "--quantization", quants, "--json")
        assert res.returncode == 0, res.stderr
        rows |= {(r["dtype"], r["quantization"]): r for r in json.loads(res.stdout)["results"]}
    assert len(rows) == 5
    base = rows[("float32", "none")]["perplexity"]
    assert 5 < base < 40 and rows[("float32", "none")]["tokens"] > 800
    # the bundled weights are dequantized Q4_1 (blocks of 32 with a scale and a minimum), so int4 in
    # groups of 32 lands almost on the same grid: every format is within a few percent here
    for key, row in rows.items():
        assert abs(row["perplexity"] / base - 1) < 0.03, (key, row["perplexity"], base)
    sizes = [rows[key]["weight_bytes"] for key in (("float32", "none"), ("float32", "int8"), ("float32", "int4"),
                                                      ("bfloat16", "none"), ("bfloat16", "int4"))]
    assert sizes[0] > sizes[1] > sizes[2] and sizes[0] > sizes[3] > sizes[4]


def test_convert_quantization_writes_a_checkpoint_generate_loads_as_is(tmp_path):
    out = tmp_path / "q4"
    res = run_cli("convert", "smollm2-135m", "-o", str(out), "--quantization", "int4", "--max-shard-size", "100MB")
    assert res.returncode == 0, res.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "shardlm", "bits": 4, "group_size": 32}
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert size < 200e6  # 538 MB float32: int4 layers plus the float32 tied embedding (113 MB)
    assert run_cli("verify", str(out)).returncode == 0
    at_load = _generate("--quantization", "int4")
    stored = _generate("--model", str(out), "--tp", "2")
    assert stored["quantization"] == "int4" and stored["token_ids"] == at_load["token_ids"]
    clash = run_cli("generate", "x", "--model", str(out), "--quantization", "int8")
    assert clash.returncode == 2 and "holds int4 weights" in clash.stderr
    manifest = tmp_path / "m.yaml"
    assert run_cli("plan", "smollm2-135m", "--devices", "2xcpu-4GB", "--tp", "2", "-o", str(manifest)).returncode == 0
    refused = run_cli("shard", str(out), "--manifest", str(manifest), "-o", str(tmp_path / "ranks"))
    assert refused.returncode == 2 and "quantized checkpoint" in refused.stderr
    again = run_cli("convert", str(out), "-o", str(tmp_path / "again"), "--quantization", "int8")
    assert again.returncode == 2 and "already quantized" in again.stderr
    bad = run_cli("convert", "smollm2-135m", "-o", str(tmp_path / "bad"), "--quantization", "int3")
    assert bad.returncode == 2 and "use int8 or int4" in bad.stderr


def test_an_int8_embedding_keeps_tokens_layout_free_and_perplexity_prints_its_cost():
    one = _generate("--quantization", "int4", "--quantize-embedding")
    assert one["embedding"] == "int8"
    for flags in (("--tp", "2"), ("--pp", "2")):  # pp 2: the last stage quantizes its own copy of the tied head
        assert _generate("--quantization", "int4", "--quantize-embedding", *flags)["token_ids"] == one["token_ids"]
    res = run_cli("perplexity", "--quantization", "int4", "--quantize-embedding")
    assert res.returncode == 0, res.stderr
    rows = [line.split("│") for line in res.stdout.splitlines() if line.count("│") > 5 and "int4" in line]
    assert [r[3].strip() for r in rows] == ["float", "int8"], rows
    cost = float(rows[1][6].strip().rstrip("%"))  # the int8-embedding row against its float-embedding twin
    assert abs(cost) < 3, cost
