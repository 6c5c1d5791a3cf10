"""The manifest: Plan -> YAML -> the same Plan, atomic writes, and an error naming line and field for each bad input."""

import os
import re
from pathlib import Path

import pytest
import yaml

from shardlm.manifest import (HEADER, ManifestError, parse_manifest, plan_to_yaml, read_manifest,
                              write_manifest)
from shardlm.plan.layout import ParallelLayout
from shardlm.plan.plan import (KVBudget, ModelRef, Monitoring, Offload, Performance, Plan, Predictions, RankMemory,
                               Serving)


def plan_2x2x2(predictions: bool = True) -> Plan:
    """tp 2, pp 2, dp 2 on devices 0:0..0:7, rank = (replica * pp + stage) * tp + tp_rank."""
    devices = tuple(tuple(tuple(f"0:{(r * 2 + s) * 2 + t}" for t in range(2)) for s in range(2)) for r in range(2))
    layout = ParallelLayout(2, 2, 2, ((0, 3), (3, 5)), devices)
    pred = None
    if predictions:
        memory = tuple(RankMemory(c.rank, c.device, "H100-80GB", 17_000_000_000 + c.rank, 2_000_000, 3_000,
                                  500_000_000, 85_000_000_000, offloaded=c.rank) for c in layout.coords())
        perf = Performance(1234.5, 0.0125, 640.0, 80.0, (0.006, 0.0065), 0.5, 2, {"weights": 0.01, "kv": 0.0025})
        pred = Predictions(memory, perf, ("bandwidth efficiency 0.8: uncalibrated", "yes"))
    return Plan(ModelRef("tiny", "LlamaForCausalLM", 12345, 5), "8xH100-80GB", "bfloat16", "int8", layout,
                KVBudget(4, 256, 128), "throughput", Offload("cpu", (0, 1)), Serving("0.0.0.0", 9000),
                Monitoring(False, True), pred)


def plan_tp3() -> Plan:
    layout = ParallelLayout(3, 1, 1, ((0, 30),), ((("0:0", "0:1", "1:2"),),))
    return Plan(ModelRef("smollm2-135m", "", 0, 30), "local", "float32", "none", layout, KVBudget(1, 4096, 2048))


@pytest.mark.parametrize("plan", [plan_2x2x2(), plan_2x2x2(predictions=False), plan_tp3()],
                         ids=["2x2x2", "2x2x2-no-predictions", "tp3"])
def test_round_trip(plan):
    text = plan_to_yaml(plan)
    assert text.splitlines()[0] == HEADER
    assert parse_manifest(text) == plan
    assert plan_to_yaml(parse_manifest(text)) == text  # stable


def test_written_for_people():
    text = plan_to_yaml(plan_2x2x2())
    doc = yaml.safe_load(text)
    assert list(doc)[:5] == ["version", "model", "cluster", "device", "dtype"] and doc["version"] == 1
    assert doc["stages"][1]["devices"] == [["0:2", "0:3"], ["0:6", "0:7"]]  # by stage, then replica
    assert doc["predictions"]["memory"][0]["total"] == 17_502_003_000
    assert "weights: 17000000000  # 15.8 GiB" in text and 'devices:\n  - ["0:0", "0:1"]' in text


def test_optional_fields_take_defaults():
    plan = parse_manifest(BASE.replace("offload: {tier: none, layers: []}\nserving: {host: 127.0.0.1, port: 8000}\n",
                                       "serving:\n"))
    assert (plan.cluster, plan.quantization, plan.objective) == ("local", "none", "latency")
    assert (plan.offload, plan.serving, plan.monitoring, plan.predictions) == (Offload(), Serving(), Monitoring(), None)
    assert plan.kv == KVBudget(2, 64, 64) and plan.model == ModelRef("tiny", "", 0, 4)
    assert parse_manifest(BASE.replace("{name: tiny, layers: 4}", "{name: tiny}")).model.n_layers == 4


def test_write_is_atomic(tmp_path, monkeypatch):
    target = tmp_path / "m.yaml"
    write_manifest(plan_tp3(), target)
    assert read_manifest(target) == plan_tp3() and os.listdir(tmp_path) == ["m.yaml"]
    before = target.read_text()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_manifest(plan_2x2x2(), target)
    assert target.read_text() == before and os.listdir(tmp_path) == ["m.yaml"]  # untouched, no temp left


def test_read_errors_name_the_path(tmp_path):
    with pytest.raises(ManifestError, match=r"nope\.yaml: no such manifest file"):
        read_manifest(tmp_path / "nope.yaml")
    with pytest.raises(ManifestError, match="cannot read the manifest"):
        read_manifest(tmp_path)
    (tmp_path / "bad.yaml").write_text(BASE.replace("tensor: 2", "tensor: two"))
    with pytest.raises(ManifestError, match=r"bad\.yaml:5: parallelism\.tensor: expected an integer >= 1, got 'two'; "
                                            r"set it to the tensor-parallel degree, e.g. 2"):
        read_manifest(tmp_path / "bad.yaml")


BASE = """\
version: 1
model: {name: tiny, layers: 4}
dtype: float32
parallelism:
  tensor: 2
  pipeline: 2
  data: 1
stages:
  - layers: [0, 2]
    devices: [["0:0", "0:1"]]
  - layers: [2, 4]
    devices: [["0:2", "0:3"]]
kv_cache: {max_batch: 2, max_seq_len: 64}
offload: {tier: none, layers: []}
serving: {host: 127.0.0.1, port: 8000}
"""

# (old, new) replaced in BASE -> what the error must say, starting with ":LINE: field.path".
ERRORS = {
    "syntax": (("  tensor: 2", "  tensor: 2: 3"), ":5: not valid YAML"),
    "version-missing": (("version: 1", "# no version"), ":2: version: missing; this shardlm reads schema version 1"),
    "version-2": (("version: 1", "version: 2"), ":1: version: unsupported schema version 2"),
    "unknown-top": (("parallelism:", "paralelism:"), ":4: paralelism: unknown key (did you mean 'parallelism'?)"),
    "unknown-inner": (("  data: 1", "  dta: 1"), ":7: parallelism.dta: unknown key (did you mean 'data'?)"),
    "duplicate-key": (("max_batch: 2,", "max_batch: 2, max_batch: 3,"), ":13: kv_cache.max_batch: appears twice"),
    "missing-model": (("model: {name: tiny, layers: 4}", "# no model"), ":1: model: missing; add it at the top level"),
    "missing-name": (("{name: tiny, layers: 4}", "{layers: 4}"), ":2: model.name: missing; add it under model"),
    "missing-data": (("  data: 1", "  # data"), ":4: parallelism.data: missing"),
    "missing-devices": (('    devices: [["0:2", "0:3"]]', "    # devices"), ":11: stages[1].devices: missing"),
    "missing-seq-len": (("max_seq_len: 64", "prefill_chunk: 64"), ":13: kv_cache.max_seq_len: missing"),
    "string-for-int": (("tensor: 2", "tensor: two"), ":5: parallelism.tensor: expected an integer >= 1, got 'two'"),
    "bool-for-int": (("pipeline: 2", "pipeline: true"), ":6: parallelism.pipeline: expected an integer >= 1, got true"),
    "float-for-int": (("max_batch: 2", "max_batch: 2.5"), ":13: kv_cache.max_batch: expected an integer >= 1, got 2.5"),
    "zero-degree": (("data: 1", "data: 0"), ":7: parallelism.data: expected an integer >= 1, got 0"),
    "list-for-mapping": (("{name: tiny, layers: 4}", "[tiny]"), ":2: model: expected a mapping, got a list"),
    "mapping-for-list": (("layers: [0, 2]", "layers: {start: 0}"), ":9: stages[0].layers: expected a list"),
    "bool-for-string": (("name: tiny", "name: yes"), ":2: model.name: expected a string, got yes"),
    "dtype": (("dtype: float32", "dtype: bf16"), ":3: dtype: expected one of float32, bfloat16, float16, got 'bf16'"),
    "quantization": (("dtype: float32", "quantization: int3\ndtype: float32"), ":3: quantization: expected one of"),
    "objective": (("dtype: float32", "objective: speed\ndtype: float32"), ":3: objective: expected one of latency"),
    "offload-tier": (("tier: none", "tier: gpu"), ":14: offload.tier: expected one of none, cpu, disk, got 'gpu'"),
    "too-few-stages": (("pipeline: 2", "pipeline: 3"), ":8: stages: 2 stage(s) listed but parallelism.pipeline is 3"),
    "replicas": (("data: 1", "data: 2"), ":10: stages[0].devices: 1 replica list(s) but parallelism.data is 2"),
    "flat-devices": (('[["0:0", "0:1"]]', '["0:0", "0:1"]'), ":10: stages[0].devices[0]: expected a list, got '0:0'"),
    "tp-count": (('[["0:2", "0:3"]]', '[["0:2"]]'), ":12: stages[1].devices[0]: 1 device(s) but parallelism.tensor"),
    "range-overlap": (("layers: [2, 4]", "layers: [1, 4]"), ":11: stages[1].layers: stage 1 starts at layer 1"),
    "range-gap": (("layers: [2, 4]", "layers: [3, 4]"), ":11: stages[1].layers: stage 1 starts at layer 3"),
    "range-empty": (("layers: [0, 2]", "layers: [0, 0]"), ":9: stages[0].layers: stage 0 has the empty layer range"),
    "range-arity": (("layers: [0, 2]", "layers: [0, 1, 2]"), ":9: stages[0].layers: expected [start, stop]"),
    "bad-address": (('"0:3"', '"gpu3"'), ":12: stages[1].devices[0][1]: expected a device address node:index"),
    "same-device": (('"0:3"', '"0:1"'), ":12: stages[1].devices[0][1]: device '0:1' is already used by "
                                        "stages[0].devices[0][1] (line 10)"),
    "model-layers": (("layers: 4}", "layers: 5}"), ":2: model.layers: 5 layers but the stages end at layer 4"),
    "offload-count": (("tier: none, layers: []", "tier: cpu, layers: [1]"), ":14: offload.layers: 1 count(s) for 2"),
    "offload-too-many": (("tier: none, layers: []", "tier: cpu, layers: [0, 3]"),
                         ":14: offload.layers[1]: 3 offloaded layers but the stage has only 2"),
    "offload-no-tier": (("tier: none, layers: []", "tier: none, layers: [1, 0]"),
                        ":14: offload.layers: lists offloaded layers but offload.tier is none"),
    "port-high": (("port: 8000", "port: 70000"), ":15: serving.port: expected an integer in 1..65535, got 70000"),
    "port-zero": (("port: 8000", "port: 0"), ":15: serving.port: expected an integer in 1..65535, got 0"),
}


@pytest.mark.parametrize("edit, expected", ERRORS.values(), ids=ERRORS.keys())
def test_error_names_line_and_field(edit, expected):
    text = BASE.replace(*edit)
    assert text != BASE, f"the edit {edit} did not apply"
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, source="m.yaml")
    assert str(info.value).startswith("m.yaml" + expected), str(info.value)
    assert "; " in str(info.value)  # every message ends with a fix


@pytest.mark.parametrize("text, expected", [
    ("", "m.yaml:1: the manifest is empty"),
    ("# only a comment\n", "m.yaml:1: the manifest is empty"),
    ("- 1\n- 2\n", "m.yaml:1: expected a mapping of fields at the top level, got a list"),
    ("version: 1\nmodel: {name: [\n", "m.yaml:3: not valid YAML"),
    ("version: 1\nname: 'unclosed\n", "m.yaml:3: not valid YAML"),
])
def test_not_a_manifest(text, expected):
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, source="m.yaml")
    assert str(info.value).startswith(expected), str(info.value)


def _predictions_text(old: str, new: str) -> str:
    text = plan_to_yaml(plan_2x2x2())
    assert old in text
    return text.replace(old, new, 1)


@pytest.mark.parametrize("old, new, path, expected", [
    ("total: 17502003000", "total: 17502003001", "predictions.memory[0].total", "17502003001 is not weights"),
    ("imbalance: 0.04", "imbalance: 0.5", "predictions.performance.imbalance", "0.5 but stage_times_s give 0.04"),
    ("bubble: 0.5", "bubble: lots", "predictions.performance.bubble", "expected a number >= 0, got 'lots'"),
    ('device: "0:0"', "device: gpu0", "predictions.memory[0].device", "expected a device address"),
    ("    weights: 17000000000", "    # weights", "predictions.memory[0].weights", "missing"),
    ("stage_times_s: [0.006, 0.0065]", "stage_times_s: []", "predictions.performance.stage_times_s", "is empty"),
])
def test_prediction_errors(old, new, path, expected):
    text = _predictions_text(old, new)
    at = "- rank: 0" if expected == "missing" else new  # a missing field: the line of its mapping
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if at in ln)
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, source="m.yaml")
    assert str(info.value).startswith(f"m.yaml:{line}: {path}: {expected}"), str(info.value)
    assert "delete the whole predictions section" in str(info.value)


def test_predictions_read_leniently():
    """Derived fields may be left out, and 1e-3 (a string to YAML 1.1) is a number."""
    text = _predictions_text("    total: 17502003000  # 16.3 GiB\n", "").replace("decode_latency_s: 0.0125",
                                                                                 "decode_latency_s: 1.25e-2")
    text = text.replace("    imbalance: 0.04\n", "")
    assert parse_manifest(text) == plan_2x2x2()


def test_sexagesimal_device_address_is_read_as_written():
    # Unquoted, YAML 1.1 reads 1:2 as the integer 62; the manifest keeps the text.
    plan = parse_manifest(BASE.replace('"0:3"', "1:2"))
    assert plan.layout.devices[0][1] == ("0:2", "1:2")


def test_docs_examples_parse():
    doc = (Path(__file__).parents[2] / "docs" / "manifest.md").read_text()
    examples = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    assert len(examples) == 2
    for text in examples:
        parse_manifest(text, source="docs/manifest.md")


def test_a_plan_runs_on_its_own_device_kind_and_a_contradicting_device_is_refused():
    from dataclasses import replace

    from shardlm.engine.checks import UserError, check_runnable, for_device

    gpu = parse_manifest(plan_to_yaml(replace(plan_tp3(), cluster="8xH100-80GB", device="cuda")))
    assert gpu.device == "cuda" and for_device(gpu, None, "m.yaml").device == "cuda"
    with pytest.raises(UserError, match="device: cuda.*--device cpu was given"):
        for_device(gpu, "cpu", "m.yaml")
    cpu = replace(plan_tp3(), cluster="2xcpu-4GB")
    with pytest.raises(UserError, match="--device cuda was given"):
        for_device(cpu, "cuda", "m.yaml")
    for device in ("cpu", "cuda"):  # "local": whatever the planning machine had; --device decides
        assert for_device(replace(plan_tp3(), cluster="local"), device, "m.yaml").device == device
    old = parse_manifest(re.sub(r"^device: .*\n", "", plan_to_yaml(replace(plan_tp3(), cluster="8xH100-80GB")),
                                flags=re.M))
    assert old.device == "cuda"  # a manifest without `device` takes it from its cluster
    with pytest.raises(UserError, match="offload.tier: cpu"):
        check_runnable(replace(cpu, offload=Offload("cpu", (1,))), "m.yaml")
