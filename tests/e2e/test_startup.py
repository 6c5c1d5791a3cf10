"""Start-up cost: the driver (CLI) never imports torch; only the ranks do, in parallel."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
from shardlm.cli import app
try:
    app({args!r}, standalone_mode=False)
finally:
    sys.stdout.flush()
print("\\nTORCH_IMPORTED=" + str("torch" in sys.modules))
"""


def _driver(args: list[str]) -> str:
    res = subprocess.run([sys.executable, "-c", CHECK.format(args=args)], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.parametrize("args", [
    ["generate", "The capital of France is", "--tp", "2", "--max-new-tokens", "2", "--json"],
    ["generate", "Name a colour.", "--chat", "--max-new-tokens", "2", "--json"],  # the template without transformers
    ["inspect", "smollm2-135m"],
    ["plan", "smollm2-135m", "--devices", "2xcpu-4GB"],
])
def test_the_driver_never_imports_torch(args):
    out = _driver(args)
    assert out.rstrip().endswith("TORCH_IMPORTED=False"), out[-2000:]
    if args[0] == "generate" and "--chat" not in args:
        assert '"text": [" Paris' in out


def test_the_command_entry_point_imports_nothing_heavy():
    # spawn re-imports the launching script in every rank: it must not pull in the CLI
    code = "import sys, shardlm.__main__; print(sorted(m for m in ('shardlm.cli', 'typer', 'rich', 'torch') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr


def test_a_script_without_the_main_guard_is_told_why_its_ranks_died(tmp_path):
    script = tmp_path / "noguard.py"
    script.write_text("from shardlm.engine import LocalEngine\n"
                      "from shardlm.engine.session import plan_run\n"
                      "LocalEngine(*plan_run()).start()\n")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "died with exit code 1 before it could report" in res.stderr and "__main__" in res.stderr, res.stderr[-3000:]
