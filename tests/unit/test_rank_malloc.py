"""A rank's malloc settings (runtime.worker.set_malloc): activations reuse heap pages instead of faulting in new ones.

Each case runs in a fresh interpreter, since glibc's thresholds move with what a process has freed so far.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds set are glibc's")

PATTERN = """
import json, resource, sys, torch
from shardlm.runtime.worker import set_malloc
if sys.argv[1] == "keep":
    assert set_malloc(offloads=False)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
# "small": 40 activations of 100 kB (about 4 MB); "large": three of 1.2, 2 and 4 MB, as a 512-token prefill's
sizes = [25_000] * 40 if sys.argv[2] == "small" else [300_000, 500_000, 1_000_000]
rounds = []
for _ in range(8):
    f0 = faults()
    held = [torch.ones(n) for n in sizes]
    del held
    rounds.append(faults() - f0)
print(json.dumps(rounds))
"""


def _page_faults(mode: str, sizes: str = "small") -> list[int]:
    """Minor page faults of each of 8 rounds of the pattern, in a fresh interpreter (`mode` "keep" or "default";
    `sizes` "small" or "large")."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-c", PATTERN, mode, sizes], capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_rank_that_keeps_its_layers_reuses_heap_pages_for_activations():
    """With glibc's starting thresholds the heap's free top (4 MB) goes back to the system after every round, and
    the next round faults it in again (about 1000 faults a round here); with the rank's settings it stays."""
    default = _page_faults("default")
    if min(default[-3:]) < 100:
        pytest.skip(f"this glibc keeps the heap's top without the settings too (faults a round: {default})")
    kept = _page_faults("keep")
    assert max(kept[-3:]) < 20, f"faults a round with the rank's settings: {kept} (without: {default})"


def test_a_rank_that_keeps_its_layers_keeps_activations_of_megabytes_on_the_heap():
    """Blocks of 1-4 MB (a prefill's activations) come from the heap and its pages stay: with the mmap threshold
    left where glibc starts it (128 KiB, frozen once any threshold is set by hand) each would be mapped afresh and
    faulted in at every use, about 1800 faults a round."""
    kept = _page_faults("keep", "large")
    assert max(kept[-3:]) < 20, f"faults a round with the rank's settings: {kept}"
