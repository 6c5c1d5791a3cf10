"""Bad cluster files, closed as classes like manifests: one line naming file, line, field and fix, never a traceback."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from shardlm.hardware import HardwareError, load_cluster
from shardlm.hardware.cluster_file import LIMITS

GOOD = """\
nodes:
  - name: box-a
    cores: 16
    devices:
      - {type: T4, count: 2, memory: 12GB}
      - {type: my-accel, memory: 40GB, bandwidth: 1.2TB/s, flops: 200TFLOPS}
inter_node: {bandwidth: 100GB/s, latency: 3us}
"""


def error_of(tmp_path, text: str) -> str:
    """The message of the HardwareError a cluster file of `text` raises, checked to be one bounded line."""
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    with pytest.raises(HardwareError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message and len(message) < 800 + len(str(path)), message[:2000]
    return message.replace(str(path), "c.yaml")


@pytest.fixture(autouse=True)
def no_calibration(tmp_path, monkeypatch):
    """An empty $SHARDLM_HOME: no real calibration file leaks in."""
    monkeypatch.setenv("SHARDLM_HOME", str(tmp_path / "home"))


def test_the_good_file_loads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(GOOD)
    cluster = load_cluster(path)
    assert len(cluster.devices) == 3 and cluster.nodes[0].cores == 16 and cluster.inter_bandwidth == 100e9


@pytest.mark.parametrize("old, new, expected", [
    ("count: 2", "count: 0x2", "c.yaml:5: nodes[0].devices[0].count: expected an integer >= 1, got 0x2 (YAML 1.1 "
                               "would read that as 2; shardlm reads plain decimal only)"),
    ("count: 2", "count: 02", "c.yaml:5: nodes[0].devices[0].count: expected an integer >= 1, got 02 (YAML 1.1"),
    ("cores: 16", "cores: 1:0", "c.yaml:3: nodes[0].cores: expected an integer >= 1, got 1:0 (YAML 1.1 would "
                                "read that as 60"),
    ("count: 2", "count: yes", "c.yaml:5: nodes[0].devices[0].count: expected an integer >= 1, got yes"),
    ("memory: 12GB", "memory: 1e400GB", "c.yaml:5: nodes[0].devices[0].memory: a size '1e400GB' is too large; "
                                        "write it like 4GB"),
    ("memory: 12GB", "memory: " + "9" * 500, "c.yaml:5: nodes[0].devices[0].memory: cannot read '999"),
    ("memory: 12GB", "memory: [12GB]", "c.yaml:5: nodes[0].devices[0].memory: expected a size > 0 like 40GB, "
                                       "got a list"),
    ("name: box-a", "name: yes", 'c.yaml:2: nodes[0].name: expected a string, got yes; set it to the host name or '
                                 'a label, e.g. box-a (to mean the text, quote it: "yes")'),
    ("type: T4", "type: '" + "x" * 5000 + "'", "c.yaml:5: nodes[0].devices[0].type: is 5000 characters long"),
    ("my-accel", "*t", "c.yaml:6: nodes[0].devices[1].type: an alias (*t) is not supported"),
    ("latency: 3us", "latency: 3us, latency: 4us", "c.yaml:7: inter_node.latency: appears twice (first on line 7)"),
])
def test_bad_values(tmp_path, old, new, expected):
    text = GOOD.replace(old, new, 1)
    assert text != GOOD
    assert error_of(tmp_path, text).startswith(expected)


def test_caps(tmp_path):
    assert "more than the 262144 a cluster file may have" in error_of(tmp_path, GOOD + "#" * LIMITS.max_chars)
    assert f"nested more than {LIMITS.max_depth} levels deep" in error_of(tmp_path, "nodes: " + "[" * 10_000)
    assert "a second YAML document starts here" in error_of(tmp_path, GOOD + "---\nnodes: []\n")
    assert "c.yaml:1: the cluster file is empty" in error_of(tmp_path, "# nothing\n")


@settings(max_examples=150, deadline=None)  # inputs stay a few hundred characters
@given(data=st.data())
def test_fuzz_edits(tmp_path_factory, data):
    """Random edits of a good cluster file: a Cluster or a one-line HardwareError, nothing else."""
    text = GOOD
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(text)))
        insert = data.draw(st.one_of(st.sampled_from(["0400", "4:16", "yes", "~", "[", "{", "*a", "&a", "!!int",
                                                      "1e400", "-1", "0GB", "cpu", "\t", "é"]), st.text(max_size=8)))
        text = text[:at] + insert + text[at + data.draw(st.integers(0, 12)):]
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_cluster(path)
    except HardwareError as e:
        assert "\n" not in str(e) and len(str(e)) < 800 + len(str(path)), str(e)[:2000]
