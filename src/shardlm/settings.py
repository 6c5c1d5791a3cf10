"""Settings read from the environment, in one place, once at start-up.

The driver reads them (`Settings.from_env()`) when a command starts and hands them to every rank in
its launch message; nothing below reads an environment variable itself. Variables:

- ``SHARDLM_HOME``: the cache folder (bundled model, compiled kernels, calibration, offload files);
  default ``~/.cache/shardlm``.
- ``SHARDLM_KERNELS``: CPU linear kernels, ``auto`` (default), ``gemv``, ``onednn`` or ``torch``.
- ``SHARDLM_FUSED``: ``0`` turns the fused CPU decode step and the fused float32 prefill off (default on).
- ``SHARDLM_CUDA_GRAPHS``: ``0`` turns CUDA-graph decode off (default on).
- ``SHARDLM_CUDA_COMPILE``: ``1`` compiles ``runtime.step.generate``'s CUDA-graph decode step with
  ``torch.compile`` before it is captured (fewer, fused kernels per replay; tens of seconds of compiling at a
  new shape); default off. The engine's captured steps (runtime/slot_graphs.py) are not compiled.
- ``SHARDLM_CUDA_JOIN``: ``0`` keeps q/k/v and gate/up as separate products on GPU ranks (default: one
  product each, runtime/projections.py).
- ``SHARDLM_CUDA_GEMV``: ``1`` runs a one-GPU rank's batch-1 decode blocks as Triton GEMV kernels with the norms,
  gating and residual adds inside, attention split over the keys and greedy tokens by an argmax kernel
  (runtime/gpu_blocks.py); default off. With ``SHARDLM_CUDA_COMPILE=1`` a Llama-3.2-1B bfloat16 step reached 71-72 %
  of an H200's copy-bandwidth floor (bench/RESULTS.md).
- ``SHARDLM_BATCH_INVARIANT``: ``0`` lets a one-GPU serving rank with CUDA-graph decode prefill several prompts'
  chunks in one forward pass, and the engine fill each step's prefill budget by cutting chunks short (sooner
  first tokens when many prompts arrive at once); by default each chunk is its prompt's own and runs in its own
  pass, as a GPU's products round a row by the rows beside it (runtime/serve_step.py, engine/scheduler.py), and
  such a rank keeps attention off cuDNN's SDPA kernel, which parted rows and runs (runtime/slot_graphs.py). Other
  ranks always share passes: CPU kernels round a row alike in any batch, and GPU ranks without graph decode
  (tensor-parallel, pipelined, streamed layers, SHARDLM_CUDA_GRAPHS=0) decode only the rows in use anyway.
- ``SHARDLM_OFFLOAD_UNCACHED``: ``1`` evicts streamed layers from the page cache after each use, so
  every step reads the disk (benchmarks of the worst case).
- ``SHARDLM_HUGE_PAGES``: ``0`` keeps rank processes on glibc's default pages; by default a rank whose weights stay
  in memory runs malloc with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (transparent huge pages, engine/ranks.py).
- ``SHARDLM_COLLECTIVE_TIMEOUT_S``: how long a rank waits for its peers inside a collective, and the
  driver for one step's result, before the rank (or the run) is reported hung; default 300 seconds.
  Idle ranks wait in no collective, so an engine may sit idle far longer than this.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

DEFAULT_HOME = "~/.cache/shardlm"
KERNEL_MODES = ("auto", "gemv", "onednn", "torch")


class SettingsError(ValueError):
    """An environment variable with a value shardlm cannot use; names the variable and the accepted values."""


def home(environ: Mapping[str, str] | None = None) -> Path:
    """The shardlm cache folder: ``$SHARDLM_HOME``, default ``~/.cache/shardlm``."""
    env = os.environ if environ is None else environ
    return Path(env.get("SHARDLM_HOME") or DEFAULT_HOME).expanduser()


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise SettingsError(f"{name}={value!r} is not 0 or 1; unset it or set it to 0 (off) or 1 (on)")
    return value == "1"


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 1 <= seconds <= 86400:  # nan fails too
        raise SettingsError(f"{name}={value!r} is not a number of seconds in 1..86400; unset it (default "
                            f"{default:.0f}) or give one, e.g. {name}=600")
    return seconds


@dataclass(frozen=True)
class Settings:
    """How this process and its ranks run, beyond the Plan (picklable: sent to every rank)."""

    home: Path = field(default_factory=home)
    """Cache folder."""
    kernels: str = "auto"
    """CPU linear kernels: auto | gemv | onednn | torch."""
    fused: bool = True
    """Run CPU decode steps through the fused per-block kernel, and float32 prefill blocks with their element-wise
    work compiled, where they apply."""
    cuda_graphs: bool = True
    """Replay decode steps as CUDA graphs where they apply (one GPU, nothing streamed)."""
    cuda_compile: bool = False
    """Compile the CUDA-graph decode step with torch.compile before capturing it."""
    cuda_join: bool = True
    """On GPU ranks, one product for q/k/v and one for gate/up (runtime/projections.py)."""
    cuda_gemv: bool = False
    """On one-GPU ranks with CUDA-graph decode, batch-1 decode blocks as Triton GEMV kernels with the norms, gating
    and residual adds inside (runtime/gpu_blocks.py)."""
    cuda_ahead: bool = True
    """On a serving rank with CUDA-graph decode, launch greedy decode steps before the one ahead of them is read
    back (runtime/ahead.py)."""
    batch_invariant: bool = True
    """On a one-GPU serving rank with CUDA-graph decode, each prompt chunk its own and in its own pass (see
    SHARDLM_BATCH_INVARIANT)."""
    offload_uncached: bool = False
    """Evict streamed layers from the page cache after each use (benchmarks)."""
    huge_pages: bool = True
    """Rank processes whose weights stay in memory get transparent huge pages from malloc (SHARDLM_HUGE_PAGES)."""
    collective_timeout_s: float = 300.0
    """Longest wait inside a collective, and for one step's result (SHARDLM_COLLECTIVE_TIMEOUT_S)."""
    log_level: str = "WARNING"
    """Level of the rank processes' log lines (the CLI's -v sets INFO)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Settings from the environment (`environ`, default os.environ); SettingsError for a bad value."""
        env = os.environ if environ is None else environ
        kernels = env.get("SHARDLM_KERNELS") or "auto"
        if kernels not in KERNEL_MODES:
            raise SettingsError(f"SHARDLM_KERNELS={kernels!r} is not one of {', '.join(KERNEL_MODES)}; unset it or "
                                "pick one")
        values = dict(home=home(env), kernels=kernels, fused=_flag(env, "SHARDLM_FUSED", True),
                      cuda_graphs=_flag(env, "SHARDLM_CUDA_GRAPHS", True),
                      cuda_compile=_flag(env, "SHARDLM_CUDA_COMPILE", False),
                      cuda_join=_flag(env, "SHARDLM_CUDA_JOIN", True),
                      cuda_gemv=_flag(env, "SHARDLM_CUDA_GEMV", False),
                      cuda_ahead=_flag(env, "SHARDLM_CUDA_AHEAD", True),
                      batch_invariant=_flag(env, "SHARDLM_BATCH_INVARIANT", True),
                      offload_uncached=_flag(env, "SHARDLM_OFFLOAD_UNCACHED", False),
                      huge_pages=_flag(env, "SHARDLM_HUGE_PAGES", True),
                      collective_timeout_s=_seconds(env, "SHARDLM_COLLECTIVE_TIMEOUT_S", 300.0))
        return cls(**{**values, **overrides})

    @property
    def offload_dir(self) -> Path:
        """Where streamed layers go when no folder is given."""
        return self.home / "offload"

    @property
    def kernel_dir(self) -> Path:
        """Where the compiled decode kernels are cached."""
        return self.home / "kernels"


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
"""With it glibc (2.35 and later) asks the kernel for transparent huge pages (madvise) on the memory malloc takes."""


@contextlib.contextmanager
def huge_page_children(on: bool) -> Iterator[None]:
    """While open, the processes this one starts run glibc's malloc with HUGE_PAGES_TUNABLE, so a rank's weights
    land on 2 MiB pages as they are read (the kernel's THP mode "madvise" or "always"; a libc or kernel without it
    ignores the tunable). engine/ranks.py opens it around each rank's start. Streamed through 2 MiB pages, 30
    layers of 3072 x 576 float32 weights took 4.76-5.13 ms at 16 rows against 4.99-5.85 ms on 4 KiB pages
    (alternating runs, bench/RESULTS.md). `on` False: no change."""
    if not on:
        yield
        return
    old = os.environ.get("GLIBC_TUNABLES")
    kept = [t for t in (old or "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")]
    os.environ["GLIBC_TUNABLES"] = ":".join(kept + [HUGE_PAGES_TUNABLE])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = old
