"""Every numeric and path option of every command is checked here, by its type, before a command runs.

Each option names one of these types as its Typer `parser`, called while the command line is parsed,
so a bad value stops the command before anything is read, spawned or written, and `cli.main` prints
the message on one line: "error: Invalid value for '--tp': 0 is outside 1..1024; ..." with
exit status 2. Bounds that depend on the model (tp at most its attention heads) are checked next,
by the plan builder, still before any rank starts.

tests/e2e/test_options.py walks every command of the CLI and tries every option of these types with
values outside their range, so an option added without one fails the test.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer

MAX_SIZE = 2**60
"""Largest size a size option accepts (1 EiB): anything above is a typo, and it keeps sizes exact integers."""


class Checked:
    """An option type, used as the option's Typer `parser`: called with the raw text, it converts and checks
    it; a bad value raises typer.BadParameter, which the parser labels with the option's name."""

    name = "value"

    def __call__(self, value):
        return self.convert(value, None, None)

    def fail(self, message: str, param=None, ctx=None):
        """Refuse the value with `message` (the option's name is added by the command line parser)."""
        raise typer.BadParameter(message)


def _shown(value) -> str:
    """A value as it appears in a message: quoted text, cut to 60 characters."""
    text = str(value)
    return repr(text[:60] + "..." if len(text) > 60 else text)


class Int(Checked):
    """A whole number in [minimum, maximum]."""

    name = "integer"

    def __init__(self, minimum: int, maximum: int, note: str = ""):
        self.minimum, self.maximum, self.note = minimum, maximum, note

    def convert(self, value, param, ctx) -> int:
        """The integer, or a usage error with the accepted range."""
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(str(value).strip(), 10)
            except ValueError:
                self.fail(f"{_shown(value)} is not a whole number; give one in {self.range()}", param, ctx)
        if not self.minimum <= number <= self.maximum:
            self.fail(f"{_shown(value)} is outside {self.range()}", param, ctx)
        return number

    def range(self) -> str:
        """e.g. "1..1024 (the tensor-parallel degree)"."""
        return f"{self.minimum}..{self.maximum}" + (f" ({self.note})" if self.note else "")


class Float(Checked):
    """A finite number in [minimum, maximum] (or (minimum, maximum] with `open_min`)."""

    name = "number"

    def __init__(self, minimum: float, maximum: float, open_min: bool = False, note: str = ""):
        self.minimum, self.maximum, self.open_min, self.note = minimum, maximum, open_min, note

    def convert(self, value, param, ctx) -> float:
        """The number, or a usage error with the accepted range (nan and inf are refused)."""
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{_shown(value)} is not a number; give one in {self.range()}", param, ctx)
        low_ok = number > self.minimum if self.open_min else number >= self.minimum
        if not math.isfinite(number) or not low_ok or number > self.maximum:
            self.fail(f"{_shown(value)} is outside {self.range()}", param, ctx)
        return number

    def range(self) -> str:
        """e.g. "(0, 1]" or "[0, 100] (0 = greedy)"."""
        low = "(" if self.open_min else "["
        return f"{low}{self.minimum:g}, {self.maximum:g}]" + (f" ({self.note})" if self.note else "")


class Size(Checked):
    """A size such as 300MB or 1.5GB (binary units: GB means GiB), at least `minimum` bytes."""

    name = "size"

    def __init__(self, minimum: int = 2**20):
        self.minimum = minimum

    def convert(self, value, param, ctx) -> int:
        """Bytes, or a usage error naming the accepted form and range."""
        from shardlm.hardware import HardwareError, parse_size

        if isinstance(value, int):
            return value
        try:
            number = parse_size(value)
        except (HardwareError, OverflowError, ValueError) as e:
            self.fail(f"{_shown(value)} is not a size ({str(e).split(';')[0]}); give one such as 500MB or 2GB",
                      param, ctx)
        if not self.minimum <= number <= MAX_SIZE:
            self.fail(f"{_shown(value)} is outside {self.minimum // 2**20}MB..1EB; give a size such as 500MB or 2GB",
                      param, ctx)
        return number


class LayerCounts(Checked):
    """Decoder layers per pipeline stage, e.g. 20,10: whole numbers >= 1."""

    name = "counts"

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        """The counts, or a usage error."""
        if isinstance(value, tuple):
            return value
        try:
            counts = tuple(int(x, 10) for x in str(value).split(","))
        except ValueError:
            self.fail(f"{_shown(value)} is not a comma-separated list of layer counts, e.g. 20,10", param, ctx)
        if min(counts) < 1 or max(counts) > 100_000:
            self.fail(f"{_shown(value)}: every stage needs 1..100000 layers, e.g. 20,10", param, ctx)
        return counts


class ExistingPath(Checked):
    """A path that must exist and be a file (`kind` "file") or a folder ("folder")."""

    def __init__(self, kind: str):
        self.kind = kind
        self.name = kind

    def convert(self, value, param, ctx) -> str:
        """The path as given, or a usage error saying what is there instead."""
        path = Path(str(value)).expanduser()
        if not path.exists():
            self.fail(f"{_shown(value)} does not exist; give an existing {self.kind}", param, ctx)
        if self.kind == "file" and not path.is_file():
            self.fail(f"{_shown(value)} is a folder, not a file; give the file's path", param, ctx)
        if self.kind == "folder" and not path.is_dir():
            self.fail(f"{_shown(value)} is a file, not a folder; give a folder", param, ctx)
        return str(value)


class ModelPath(ExistingPath):
    """A model folder, or the bundled model's name (smollm2-135m)."""

    def __init__(self):
        super().__init__("folder")
        self.name = "model"

    def convert(self, value, param, ctx) -> str:
        """The folder or the alias."""
        from shardlm.bundled import ALIASES

        if str(value).strip().lower() in ALIASES:
            return str(value)
        return super().convert(value, param, ctx)


class NewPath(Checked):
    """A path to write: a file (`kind` "file": not a folder, in an existing folder) or a folder to create
    or replace ("folder": not an existing file; its parent folder exists or can be made)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.name = kind

    def convert(self, value, param, ctx) -> str:
        """The path as given, or a usage error naming the problem."""
        text = str(value)
        if not text.strip():
            self.fail("an empty path; give a path to write", param, ctx)
        path = Path(text).expanduser()
        if self.kind == "file":
            if path.is_dir():
                self.fail(f"{_shown(value)} is a folder; give a file path inside it", param, ctx)
            if not path.parent.is_dir():
                self.fail(f"{_shown(value)}: the folder {str(path.parent)!r} does not exist; create it first",
                          param, ctx)
        elif path.exists() and not path.is_dir():
            self.fail(f"{_shown(value)} is a file, not a folder; give a folder to write into", param, ctx)
        else:
            parent = next((p for p in path.parents if p.exists()), None)
            if parent is not None and not parent.is_dir():
                self.fail(f"{_shown(value)}: {str(parent)!r} is a file, so no folder can be made there", param, ctx)
        return text


TP = Int(1, 1024, "the tensor-parallel degree; at most the model's attention heads")
PP = Int(1, 100_000, "pipeline stages; at most the model's layers")
MICRO_BATCHES = Int(1, 100_000, "micro-batches; at most the batch")
MAX_NEW_TOKENS = Int(1, 10_000_000, "at most the model's positions minus the prompt")
TOP_K = Int(0, 10_000_000, "0 keeps every token")
SEED = Int(0, 2**63 - 1)
TEMPERATURE = Float(0, 100, note="0 = greedy")
TOP_P = Float(0, 1, open_min=True)
MAX_BATCH = Int(1, 1_000_000, "sequences decoded together")
MAX_SEQ_LEN = Int(2, 100_000_000, "prompt plus generated tokens; at most the model's positions")
SHOW = Int(1, 1000, "layouts to list")
WINDOW = Int(2, 10_000_000, "tokens per scored window")
MEMORY_BUDGET = Size()
SHARD_SIZE = Size()
PORT = Int(1, 65535, "a TCP port")
MAX_QUEUE = Int(1, 1_000_000, "requests waiting for a slot")
PREFILL_CHUNK = Int(1, 1_000_000, "prompt tokens per step")
DECODE_RUN = Int(1, 256, "decode tokens a stream per step")
DRAIN_S = Float(0, 3600, note="seconds")
METRICS_INTERVAL_S = Float(0, 3600, note="seconds; 0 turns rank polling off")
TOP_INTERVAL_S = Float(0.1, 3600, note="seconds")
TOP_COUNT = Int(1, 1_000_000, "refreshes")
