"""Building and loading the compiled CPU decode kernels (csrc/): once per machine and source version.

The extension is compiled with torch's JIT extension builder and cached in the settings' kernel
folder under a name that carries a hash of this CPU (a -march=native build only runs on such CPUs)
and of the sources. A process loads it at most once per folder; a build that fails (no compiler,
no headers) is remembered as None and logged once, and the callers fall back to oneDNN or MKL.
Each load marks its folder as used; builds of the same CPU and target for other sources (older
versions of shardlm, other checkouts) that no process has loaded for STALE_DAYS are removed then,
so the folder does not grow with every upgrade.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
STALE_DAYS = 14
"""Days after its last load when another source version's build of this CPU and target is removed."""
_LOADED: dict[str, object] = {}
"""Extension modules loaded in this process, by name (None: the build failed). A cache of a loaded shared
library, as torch keeps one: it selects nothing. The name carries the CPU and source hashes, so a
module of that name loaded from any folder is the same build."""


def cpu_tag() -> str:
    """A short hash of the CPU's model and flags: a -march=native build is only valid on such CPUs."""
    info = platform.processor() + platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info += "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha1(info.encode()).hexdigest()[:10]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo), read once; empty where the file is missing."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


@functools.cache
def cpu_vendor() -> str:
    """This CPU's vendor_id (/proc/cpuinfo: "GenuineIntel", "AuthenticAMD"), read once; "" where it is missing."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (avx512_bf16 or AMX), where oneDNN's bfloat16 matmul is
    fast; without them it is several times slower than float32 (46 ms against 7 ms for 512 x 576 @ 576 x 1536 on
    an AVX2 host, measured)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def units_of(ext) -> str:
    """What a build of the compiled kernels multiplies with, named for logs and `--json` (a CPU without the newer
    instructions falls back at build time, and says so here): e.g. "int8 on avx512bw+avx512vnni, bfloat16 on
    avx512_bf16 dot products" or "int8 on avx2, bfloat16 widened to float32"."""
    bf16 = "on avx512_bf16 dot products" if ext.bf16_dot() else "widened to float32"
    return f"int8 on {ext.int8_units()}, bfloat16 {bf16}"


def compile_flags(arch: str = "native") -> list[str]:
    """The compiler flags of a build for `arch` on this CPU."""
    # no implicit contraction: every copy of a loop rounds alike (rows.h asks for FMA explicitly); 512-bit vectors
    # where the CPU has them (GCC's tuning for AMD and Intel cores prefers 256-bit ones in loops it vectorizes)
    flags = ["-O3", f"-march={arch}", "-fopenmp", "-ffp-contract=off", "-mprefer-vector-width=512"]
    if arch == "native" and cpu_vendor() == "GenuineIntel":
        flags.append("-DSHARDLM_L1_AHEAD")  # batch-1 weight streams ask for their line 4 KB on into L1 (csrc/rows.h)
    return flags


def extension(kernel_dir: Path, arch: str = "native"):
    """The compiled decode kernels, building them into `kernel_dir` on first use; None when they cannot
    be built here. `arch`: the -march target; "native" (this CPU) in use, older targets ("haswell": AVX2
    without AVX-512, "x86-64": no vector extensions past SSE2) to test the fallbacks on this machine."""
    sources = sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))
    flags = compile_flags(arch)
    # the folder and the flags are part of the key: the build command names the source path, so two checkouts
    # sharing one cache folder would otherwise rebuild each other's extension on every load
    digest = hashlib.sha1(str(CSRC).encode() + " ".join(flags).encode()
                          + b"".join(p.read_bytes() for p in sources)).hexdigest()[:8]
    target = "" if arch == "native" else "_" + arch.replace("-", "_")
    name = f"shardlm_kernels_{cpu_tag()}_{digest}{target}"
    if name not in _LOADED:
        build = Path(kernel_dir) / name
        try:
            from torch.utils.cpp_extension import load

            build.mkdir(parents=True, exist_ok=True)
            _LOADED[name] = load(name, [str(CSRC / "kernels.cpp")], extra_cflags=flags, build_directory=str(build),
                                 verbose=False)
            prune_stale_builds(Path(kernel_dir), name)
        except Exception as e:  # no compiler, no headers, an exotic CPU: fall back, say why once
            log.warning("decode kernel unavailable (%s); using oneDNN/MKL linear layers", e)
            _LOADED[name] = None
    return _LOADED[name]


def prune_stale_builds(kernel_dir: Path, name: str, days: float = STALE_DAYS) -> list[Path]:
    """Mark build `name` in `kernel_dir` as used now, and remove the builds of the same CPU and target for other
    sources that were last used more than `days` days ago. Returns the folders removed; a folder that cannot be
    removed is logged and kept. (A process still running an old build keeps its loaded library: removing the
    file does not unmap it.)"""
    # name: shardlm_kernels_<cpu tag>_<8-digit source digest><target>; the tag and digest are hex
    prefix = name[:name.index("_", len("shardlm_kernels_")) + 1]
    digest, target = name[len(prefix):len(prefix) + 8], name[len(prefix) + 8:]
    removed = []
    try:
        os.utime(kernel_dir / name)
        folders = list(kernel_dir.iterdir())
    except OSError as e:
        log.warning("kernel builds in %s not checked: %s", kernel_dir, e)
        return removed
    cutoff = time.time() - days * 86400
    for folder in folders:
        other = folder.name[len(prefix):]
        if not folder.name.startswith(prefix) or other[8:] != target or other[:8] == digest or len(other) < 8:
            continue
        try:
            if folder.is_dir() and folder.stat().st_mtime < cutoff:
                shutil.rmtree(folder)
                removed.append(folder)
        except OSError as e:
            log.warning("could not remove the stale kernel build %s: %s", folder, e)
    if removed:
        log.info("removed %d kernel builds unused for %g days from %s", len(removed), days, kernel_dir)
    return removed
