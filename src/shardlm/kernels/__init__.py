"""CPU kernels for decode, chosen once per rank and installed on its model from outside.

- "gemv" (default when a C++ compiler is present): weights stay plain; up to GEMV_MAX_ROWS rows go
  through the compiled loop (csrc/kernels.cpp, built once per machine, `build.extension`), larger
  inputs (prefill) through `F.linear`. The same extension holds the fused decode step of a whole
  block (`fused.py`, csrc/decode.h).
- "onednn" (fallback): weights are re-laid out once for oneDNN, replacing the plain copy.
- "torch": plain `F.linear` everywhere.

The rank builder (runtime/build.py) calls `choose_mode` once and installs the result with
`linear.install_linears` and `fused.install_fused`; no module reads a global or an environment
variable inside `forward`.
"""

from __future__ import annotations

from pathlib import Path

from shardlm.kernels.build import extension
from shardlm.kernels.linear import (GEMV_MAX_ROWS, FastLinear, LinearOps, OneDNNWeight, PlainWeight, install_linears,
                                    local_linear, matmul_t, onednn_available, weight_tensor)

MODES = ("auto", "gemv", "onednn", "torch")


def choose_mode(requested: str, kernel_dir: Path) -> tuple[str, object]:
    """(mode, compiled kernels or None): `requested` ("auto", "gemv", "onednn", "torch"), falling back to
    the next available one when the compiled kernels or oneDNN are missing here."""
    if requested not in MODES:
        raise ValueError(f"kernel mode {requested!r} is not one of {', '.join(MODES)}")
    if requested in ("auto", "gemv"):
        ext = extension(kernel_dir)
        if ext is not None:
            return "gemv", ext
    if requested in ("auto", "gemv", "onednn") and onednn_available():
        return "onednn", None
    return "torch", None


__all__ = ["GEMV_MAX_ROWS", "FastLinear", "LinearOps", "OneDNNWeight", "PlainWeight", "MODES", "choose_mode",
           "extension", "install_linears", "local_linear", "matmul_t", "onednn_available", "weight_tensor"]
