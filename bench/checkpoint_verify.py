"""What checking a checkpoint before use costs, per `--verify` mode.

    python bench/checkpoint_verify.py [--rounds 3] [--big-gb 2] [--no-write]

For the bundled SmolLM2-135M (float32, one file, no recorded checksums) and a random-weight Llama
of about --big-gb GB written as per-rank files for tp 2 (checksums in shardlm.json), the seconds of
`check_before_use(folder, mode)` in this process (no interpreter start-up), median of --rounds:
  headers          headers, sizes, layout, config; no data read
  changed (seen)   the default on every start after the first: headers + a stat per file
  changed (first)  the default's first start, or after a file changed: = full
  full             sha256 + NaN/Inf scan of every byte, page cache warm
  full, cold       the same after dropping the page cache (root only; else "-")
and, for scale, a bare sha256 of the same files (hashlib, one thread) and the model's bytes.
Results replace this benchmark's section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode as _decode  # noqa: E402
from checkpoint_load import big_config, drop_cache  # noqa: E402

from shardlm.bundled import default_model_dir  # noqa: E402
from shardlm.checkpoint.shard import shard  # noqa: E402
from shardlm.checkpoint.verify import check_before_use  # noqa: E402
from shardlm.models.random import write_random_checkpoint  # noqa: E402

HEADING = "## Checking checkpoints before use (bench/checkpoint_verify.py)"


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _seconds(fn, rounds: int, before=None) -> list[float]:
    out = []
    for _ in range(rounds):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _bare_sha(folder: Path) -> None:
    for f in _files(folder):
        with open(f, "rb") as fh:
            hashlib.file_digest(fh, "sha256")


def measure(folder: Path, rounds: int, home: Path) -> dict[str, list[float] | None]:
    """Seconds per mode for one checkpoint (each 'changed (first)' round starts from an empty record)."""
    seen = home / "verified.json"
    forget = lambda: seen.unlink(missing_ok=True)  # noqa: E731
    check_before_use(folder, "full")  # warm the page cache
    row = {"headers": _seconds(lambda: check_before_use(folder, "headers"), rounds),
           "changed (first)": _seconds(lambda: check_before_use(folder, "changed"), rounds, forget),
           "changed (seen)": _seconds(lambda: check_before_use(folder, "changed"), rounds),
           "full": _seconds(lambda: check_before_use(folder, "full"), rounds),
           "bare sha256": _seconds(lambda: _bare_sha(folder), rounds)}
    row["full, cold"] = _seconds(lambda: check_before_use(folder, "full"), rounds, drop_cache) if drop_cache() else None
    return row


READS = ("changed (first)", "full", "full, cold", "bare sha256")
"""The columns that read every byte (the others read headers and stat files only)."""


def _cell(xs: list[float] | None, nbytes: int, reads: bool) -> str:
    if not xs:
        return "-"
    m = statistics.median(xs)
    return f"{m:.3f} s, {nbytes / 1e6 / m:.0f} MB/s" if reads else f"{m:.3f} s"


def report(rows: list[tuple[str, int, dict]], opts) -> str:
    """The RESULTS.md section."""
    info = _decode.machine_info()
    cols = ["headers", "changed (seen)", "changed (first)", "full", "full, cold", "bare sha256"]
    lines = [HEADING, "",
             f"Run {dt.datetime.now().isoformat(timespec='minutes')} with `python bench/checkpoint_verify.py --rounds "
             f"{opts.rounds} --big-gb {opts.big_gb}`; machine: {info['cpu']}, {info['cores']} cores, {info['ram']}, "
             f"torch {info['torch']}; {_decode.uptime()}. Seconds of `check_before_use` in-process, median of "
             f"{opts.rounds}; MB/s over the checkpoint's bytes.", "",
             "| checkpoint | bytes | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for name, nbytes, row in rows:
        lines.append(f"| {name} | {nbytes / 1e6:.0f} MB | " + " | ".join(_cell(row[c], nbytes, c in READS) for c in cols) + " |")
    lines += ["", "The default (`--verify changed`) pays a full read (sha256 + NaN/Inf scan) the first time a file is "
              "seen in its current state and a stat per file after that; `--verify full` pays the read on every "
              "start; `headers` never reads data. 'bare sha256' is hashlib alone over the same files, one thread.", ""]
    return "\n".join(lines)


def main() -> None:
    """Measure, print, and (unless --no-write) replace this benchmark's RESULTS.md section."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--big-gb", type=float, default=2.0)
    ap.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md as it is")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="verify-bench-") as tmp:
        tmp = Path(tmp)
        os.environ["SHARDLM_HOME"] = str(tmp / "home")  # the record of verified files starts empty
        bundled = default_model_dir(progress=False)
        big = write_random_checkpoint(big_config(opts.big_gb), tmp / "big-hf", seed=0)
        ranks = tmp / "big-ranks"
        shard(big, ranks, 2, (), 2**30, progress=False, verify="headers")
        rows = []
        for name, folder in (("SmolLM2-135M (bundled, HF, no checksums)", bundled),
                             (f"random Llama {opts.big_gb:g} GB, per-rank tp 2 (checksums)", ranks)):
            nbytes = sum(f.stat().st_size for f in _files(folder))
            rows.append((name, nbytes, measure(folder, opts.rounds, tmp / "home")))
            print(name, {k: _cell(v, nbytes, k in READS) for k, v in rows[-1][2].items()}, flush=True)
    text = report(rows, opts)
    print(text)
    if not opts.no_write:
        _decode.write_section(text, HEADING)


if __name__ == "__main__":
    main()
