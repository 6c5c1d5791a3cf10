"""Bad manifest input, closed as classes: YAML 1.1 number forms, hosts, offload folders, size/depth/count caps,
a manifest used with another model or on other devices, and a fuzz that only ever gets a one-line ManifestError."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from shardlm.hardware import parse_devices
from shardlm.manifest import LIMITS, ManifestError, check_devices, check_model, parse_manifest, read_manifest
from shardlm.plan.plan import ModelRef

from test_manifest import BASE, plan_2x2x2, plan_tp3

MAX_MESSAGE = 800  # characters: values and keys are cut, so no message grows with its input


def error_of(text: str) -> str:
    """The message of the ManifestError `text` raises, checked to be one bounded line."""
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, source="m.yaml")
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, message
    assert len(message) < MAX_MESSAGE, message[:2000]
    return message


# ------------------------------------------------------------------------------------------- number forms

# (value written for kv_cache.max_seq_len, what the message must say after "got ")
INT_FORMS = [
    ("0400", "0400 (YAML 1.1 would read that as 256; shardlm reads plain decimal only)"),
    ("4:16", "4:16 (YAML 1.1 would read that as 256;"),
    ("0x40", "0x40 (YAML 1.1 would read that as 64;"),
    ("0b100", "0b100 (YAML 1.1 would read that as 4;"),
    ("1_000", "1_000 (YAML 1.1 would read that as 1000;"),
    ("64.0", "64.0; set it to"),
    ("6.4e1", "'6.4e1'; set it to"),  # a string to YAML 1.1 too
    ('"64"', "'64'; set it to"),
    ("true", "true; set it to"),
    ("yes", "yes; set it to"),
    ("~", "null; set it to"),
    (".inf", ".inf (YAML 1.1 would read that as inf;"),
    ("[64]", "a list; set it to"),
    ("{n: 64}", "a mapping; set it to"),
    ("-64", "-64; set it to"),
    ("9" * 50, "9999999999999999999999999999999999999999... (50 characters); set it to"),
]


@pytest.mark.parametrize("value, got", INT_FORMS, ids=[v for v, _ in INT_FORMS])
def test_integers_are_plain_decimal(value, got):
    message = error_of(BASE.replace("max_seq_len: 64", f"max_seq_len: {value}"))
    assert message.startswith(f"m.yaml:13: kv_cache.max_seq_len: expected an integer >= 1, got {got}"), message


@pytest.mark.parametrize("value, expected", [("64", 64), ("4096", 4096), ("+64", 64), ("0", None)])
def test_plain_decimal_integers_are_read(value, expected):
    text = BASE.replace("max_seq_len: 64", f"max_seq_len: {value}")
    if expected is None:
        assert "got 0" in error_of(text)
    else:
        assert parse_manifest(text).kv.max_seq_len == expected


@pytest.mark.parametrize("value, expected", [
    ("name: 0400", "0400"),  # text fields keep what is written, whatever YAML 1.1 would make of it
    ("name: 4:16", "4:16"),
    ("name: 1e3", "1e3"),
    ("name: 7b", "7b"),
    ("name: '7'", "7"),
    ("name: 1.10", "1.10"),
])
def test_text_fields_keep_the_text(value, expected):
    assert parse_manifest(BASE.replace("name: tiny", value)).model.name == expected


@pytest.mark.parametrize("value, expected", [("yes", True), ("off", False), ("True", True), ("false", False)])
def test_booleans_as_yaml_1_1_has_them(value, expected):
    text = BASE + f"monitoring: {{metrics: {value}}}\n"
    assert parse_manifest(text).monitoring.metrics is expected


@pytest.mark.parametrize("value, got", [("maybe", "'maybe'"), ("1", "1"), ('"true"', "'true'"), ("~", "null")])
def test_booleans_refuse_other_values(value, got):
    message = error_of(BASE + f"monitoring: {{metrics: {value}}}\n")
    assert message.startswith(f"m.yaml:16: monitoring.metrics: expected true or false, got {got}; "), message


def test_a_yaml_boolean_where_text_is_expected_says_to_quote_it():
    message = error_of(BASE.replace("name: tiny", "name: on"))
    assert message.startswith("m.yaml:2: model.name: expected a string, got on; ") and '(to mean the text, quote it: "on")' \
        in message


# ------------------------------------------------------------------------------------------- hosts, folders

@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "'::'", "'::1'", "localhost", "my-host.example.com", "box7"])
def test_hosts_accepted(host):
    assert parse_manifest(BASE.replace("host: 127.0.0.1", f"host: {host}")).serving.host == host.strip("'")


@pytest.mark.parametrize("host, got", [("-1", "-1"), ("''", "''"), ("'a b'", "'a b'"), ("-host", "'-host'"),
                                       ("host-", "'host-'"), ("1", "1"), ("999.1.1.1", "'999.1.1.1'"),
                                       ("a..b", "'a..b'"), ("[1]", "a list"), ("yes", "yes")])
def test_hosts_refused(host, got):
    message = error_of(BASE.replace("host: 127.0.0.1", f"host: {host}"))
    assert message.startswith(f"m.yaml:15: serving.host: expected an IP address or a host name, got {got}; "), message


def _disk(folder: str) -> str:
    return BASE.replace("tier: none, layers: []", f"tier: disk, layers: [0, 1], dir: {folder}")


def test_offload_dir_may_be_a_folder_or_one_to_make(tmp_path):
    assert parse_manifest(_disk(f"'{tmp_path}'")).offload.dir == str(tmp_path)
    assert parse_manifest(_disk(f"'{tmp_path}/new/sub'")).offload.dir == f"{tmp_path}/new/sub"
    assert parse_manifest(_disk("null")).offload.dir is None


def test_offload_dir_refuses_a_file_and_non_names(tmp_path):
    (tmp_path / "f").write_text("x")
    assert error_of(_disk(f"'{tmp_path}/f'")).startswith(
        f"m.yaml:14: offload.dir: '{tmp_path}/f' is an existing file, not a folder; set it to a folder")
    assert "offload.dir: is empty;" in error_of(_disk("''"))
    assert "offload.dir: contains a NUL character;" in error_of(_disk('"a\\0b"'))
    assert "cannot be a folder (File name too long)" in error_of(_disk("x" * 3000))


# ------------------------------------------------------------------------------------------- size and shape caps

def test_a_huge_manifest_is_refused_before_parsing():
    message = error_of("version: 1\n" + "".join(f"k{i}: {i}\n" for i in range(700_000)))  # 10 MB
    assert message.startswith(f"m.yaml: 10977791 characters, more than the {LIMITS.max_chars} a manifest may have")


def test_a_huge_file_is_refused_unread(tmp_path):
    path = tmp_path / "m.yaml"
    with open(path, "wb") as f:
        f.truncate(10 * LIMITS.max_chars)  # sparse: nothing is written, nothing may be read
    with pytest.raises(ManifestError, match=r"m\.yaml: 10485760 bytes, more than a manifest may have"):
        read_manifest(path)


def test_too_many_keys_and_values():
    text = "version: 1\nx: [" + "1, " * (LIMITS.max_values + 10) + "]\n"
    assert len(text) < LIMITS.max_chars
    assert f"more than {LIMITS.max_values} keys and values in one manifest" in error_of(text)


def test_many_unknown_keys_report_the_first():
    text = BASE + "".join(f"extra{i}: {i}\n" for i in range(20_000))
    assert error_of(text).startswith("m.yaml:16: extra0: unknown key; the keys allowed at the top level are")


@pytest.mark.parametrize("text", [
    "a: " + "[" * 100_000 + "]" * 100_000,
    "a: " + "{b: " * 100_000 + "}" * 100_000,
    "".join(" " * i + "a:\n" for i in range(0, 2000, 2)),
    "- " * 5000 + "x\n",
], ids=["flow-lists", "flow-maps", "block-maps", "block-lists"])
def test_deep_nesting_is_refused(text):
    assert f"nested more than {LIMITS.max_depth} levels deep" in error_of(text)


def test_long_values_and_keys_are_cut_in_messages():
    long = "x" * 10_000_000  # 10 MB: refused by size, not echoed
    assert "characters, more than the" in error_of(f"version: 1\nmodel: {{name: '{long}'}}\n")
    message = error_of(BASE.replace("dtype: float32", "dtype: " + "y" * 3000))
    assert message.startswith("m.yaml:3: dtype: expected one of float32, bfloat16, float16, got 'yyyy") and \
        "(3000 characters)" in message
    assert error_of(BASE.replace("dtype: float32", "dtype: " + "y" * 500_000)).startswith(
        "m.yaml:3: dtype: is 500000 characters long; shorten it to at most 4096")
    assert "is 5000 characters long; shorten it to at most 4096" in error_of(BASE.replace("tiny", "t" * 5000))
    message = error_of(BASE + "? " + "k" * 100_000 + "\n: 1\n")  # an explicit key: plain ones stop at 1024
    assert "unknown key" in message and "(100000 characters)" in message


@pytest.mark.parametrize("text, expected", [
    (BASE.replace("name: tiny", "name: &n tiny").replace("dtype: float32", "dtype: *n"),
     "m.yaml:3: dtype: an alias (*n) is not supported"),
    (BASE.replace("dtype: float32", "dtype: !!str float32"), "m.yaml:3: dtype: a YAML tag"),
    (BASE.replace("dtype: float32", "dtype: !!python/object:os.system {}"), "m.yaml:3: dtype: a YAML tag"),
    (BASE + "---\nversion: 1\n", "m.yaml:16: a second YAML document starts here"),
    (BASE.replace("dtype: float32", "dtype: float32\n? [a]\n: 1"), "m.yaml:4: keys must be plain names, got a list"),
    (BASE.replace("dtype: float32", "dtype: float32\n1: x"), "m.yaml:4: keys must be plain names, got 1"),
    ("version: 1\na: \ud800\n", "m.yaml:2: not valid text (a lone surrogate"),
    ("version: 1\na: b\x07\n", "m.yaml:2: not valid YAML (character"),
    ("hello", "m.yaml:1: expected a mapping of fields at the top level, got 'hello'"),
    ("---\n", "m.yaml:1: the manifest is empty"),
])
def test_yaml_features_a_manifest_does_not_use(text, expected):
    assert error_of(text).startswith(expected)


# ------------------------------------------------------------------------------------------- model and devices

REF = ModelRef("tiny", "LlamaForCausalLM", 12345, 5)


@pytest.mark.parametrize("ref, expected", [
    (replace(REF, n_layers=30), "m.yaml: model.layers: the manifest's stages cover 5 layers but tiny has 30; make a "
                                "manifest for tiny with `shardlm plan tiny`, or set model.name back"),
    (replace(REF, architecture="MixtralForCausalLM"),
     "m.yaml: model.architecture: the manifest is for LlamaForCausalLM but tiny is MixtralForCausalLM"),
    (replace(REF, parameters=999), "m.yaml: model.parameters: the manifest is for 12345 parameters but tiny has 999"),
    (replace(REF, name="other", n_layers=30), "use the model this manifest was made for (tiny), or make a manifest "
                                              "for other with `shardlm plan other`"),
])
def test_check_model_names_the_field_both_values_and_the_fix(ref, expected):
    with pytest.raises(ManifestError) as info:
        check_model(plan_2x2x2(), ref, "m.yaml")
    assert expected in str(info.value)


def test_check_model_skips_fields_the_manifest_leaves_out():
    check_model(plan_2x2x2(), REF, "m.yaml")
    plan = plan_tp3()  # architecture "" and parameters 0: not compared
    check_model(plan, ModelRef("smollm2-135m", "LlamaForCausalLM", 134515008, 30), "m.yaml")


@pytest.mark.parametrize("cluster, expected", [
    ("8xH100-80GB", None),
    ("4xH100-80GB", "stages[0].devices[1][0]: device '0:4' is not in cluster 4xH100-80GB (4 x H100-80GB: 0:0..0:3)"),
    ("2x4xH100-80GB", "stages[0].devices[1][0]: device '0:4' is not in cluster 2x4xH100-80GB "
                      "(2 nodes x 4 x H100-80GB: 0:0..0:3, 1:0..1:3)"),
])
def test_check_devices_against_the_cluster(cluster, expected):
    plan = plan_2x2x2()
    if expected is None:
        check_devices(plan, parse_devices(cluster), "m.yaml")
        return
    with pytest.raises(ManifestError) as info:
        check_devices(replace(plan, cluster=cluster), parse_devices(cluster), "m.yaml")
    assert str(info.value).startswith("m.yaml: " + expected) and "set `cluster` to the devices" in str(info.value)


def test_checks_against_the_named_model_and_cluster():
    from shardlm.plan.make import cluster_for, load_model

    plan = replace(plan_tp3(), cluster="2xcpu-1GB")  # three ranks on two devices
    with pytest.raises(ManifestError, match=r"m\.yaml: stages\[0\]\.devices\[0\]\[2\]: device '1:2' is not in"):
        check_devices(plan, cluster_for(plan.cluster), "m.yaml")
    plan = replace(plan, model=replace(plan.model, n_layers=31))
    with pytest.raises(ManifestError, match="model.layers: the manifest's stages cover 31 layers but smollm2-135m"):
        check_model(plan, load_model(plan.model.name)[0], "m.yaml")


# ------------------------------------------------------------------------------------------- fuzz

TRICKY = ["", "~", "0", "-1", "0400", "4:16", "0x10", "1_000", "1e400", ".nan", "yes", "'yes'", "[]", "{}", "[[]]",
          "{a: 1}", '"0:1"', "1:2", "&a x", "*a", "!!int 3", "? x", "- x", "|\n  x", "'", "\"", "[", "{", "#",
          ": x", "x: y: z", "\t", "\x00", "é", "\ud800", "9" * 40, "a" * 300, "-" * 3, "%YAML 1.1", "@"]


def _scalar_lines() -> list[int]:
    return [i for i, line in enumerate(BASE.splitlines()) if ":" in line]


@pytest.mark.parametrize("value", TRICKY, ids=[repr(v)[:20] for v in TRICKY])
def test_table_fuzz_every_line_every_tricky_value(value):
    """Each tricky value at the end of every line of BASE, and in place of the whole line."""
    lines = BASE.splitlines()
    for i in _scalar_lines():
        for edited in (lines[i].rsplit(":", 1)[0] + ": " + value, value):
            text = "\n".join(lines[:i] + [edited] + lines[i + 1:]) + "\n"
            try:
                parse_manifest(text, source="m.yaml")
            except ManifestError as e:
                assert "\n" not in str(e) and len(str(e)) < MAX_MESSAGE, str(e)[:2000]


@settings(max_examples=300, deadline=None)  # inputs stay small (sizes below), so every case is little work
@given(data=st.data())
def test_fuzz_edits_of_a_full_manifest(data):
    """Random edits of a manifest with predictions: a Plan or a one-line ManifestError, nothing else."""
    text = _full_text()
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 20))
        insert = data.draw(st.one_of(st.sampled_from(TRICKY), st.text(max_size=12)))
        text = text[:at] + insert + text[at + cut:]
    try:
        parse_manifest(text, source="m.yaml")
    except ManifestError as e:
        assert "\n" not in str(e) and len(str(e)) < MAX_MESSAGE, str(e)[:2000]


def _paths(node, path=()):
    """Every path into a parsed YAML document."""
    yield path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, path + (key,))


_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.sampled_from(TRICKY),
              st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


@functools.cache
def _full_text() -> str:
    from shardlm.manifest import plan_to_yaml

    return plan_to_yaml(plan_2x2x2())


@settings(max_examples=200, deadline=None)  # documents stay small: a few replaced values of at most 8 leaves
@given(data=st.data())
def test_fuzz_values_anywhere_in_the_document(data):
    """Any value of any type at any place of a full manifest, written by a YAML dumper: a Plan or one line."""
    doc = yaml.safe_load(_full_text())
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from([p for p in _paths(doc) if p]))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = data.draw(_VALUES)
    text = yaml.safe_dump(doc, allow_unicode=True)
    try:
        parse_manifest(text, source="m.yaml")
    except ManifestError as e:
        assert "\n" not in str(e) and len(str(e)) < MAX_MESSAGE, str(e)[:2000]
