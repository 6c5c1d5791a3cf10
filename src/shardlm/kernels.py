"""Linear-layer kernels for CPU decode, chosen once per process.

A decode step multiplies every weight matrix by one (or a few) activation rows, so it is bound by
how fast weights stream from memory. Measured on our 2-core machine (fp32, 2 threads, the bundled
model's 210 linear weights; bench/RESULTS.md): `F.linear` (MKL) ~11 GB/s, oneDNN with pre-packed
weights ~14-17 GB/s, and the small row-streaming loop in `csrc/kernels.cpp` ~26 GB/s. So:

- "gemv" (default when a C++ compiler is present): weights stay plain; up to GEMV_MAX_ROWS rows
  go through the compiled loop (built once per machine with torch's JIT extension builder, cached
  under $SHARDLM_HOME/kernels), larger inputs (prefill) through `F.linear`. The same extension
  holds the fused decode step of a whole block (`shardlm.fused`, csrc/decode.h).
- "onednn" (fallback): weights are re-laid out once for oneDNN, replacing the plain copy.
- "torch": plain `F.linear` everywhere.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

GEMV_MAX_ROWS = 8
"""Inputs with at most this many rows (decode batches) use the compiled kernel."""
_GEMV = None  # the loaded extension module, or False once building it has failed
_ACTIVE = None  # the extension module while "gemv" is the mode chosen by prepare_linears, else None


def _cpu_tag() -> str:
    """A short hash of the CPU's model and flags: a -march=native build is only valid on such CPUs."""
    info = platform.processor() + platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info += "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha1(info.encode()).hexdigest()[:10]


def gemv_module():
    """The compiled decode kernel, building it on first use; None when it cannot be built here."""
    global _GEMV
    if _GEMV is None:
        try:
            from torch.utils.cpp_extension import load

            from shardlm.paths import home

            csrc = Path(__file__).parent / "csrc"
            src = csrc / "kernels.cpp"
            digest = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(csrc.iterdir()) if p.suffix in (".cpp", ".h")))
            name = f"shardlm_kernels_{_cpu_tag()}_{digest.hexdigest()[:8]}"
            build = home() / "kernels" / name
            build.mkdir(parents=True, exist_ok=True)
            _GEMV = load(name, [str(src)], extra_cflags=["-O3", "-march=native", "-fopenmp"], build_directory=str(build),
                         verbose=False)
        except Exception as e:  # no compiler, no headers, an exotic CPU: fall back, say why once
            log.warning("decode kernel unavailable (%s); using oneDNN/MKL linear layers", e)
            _GEMV = False
    return _GEMV or None


def choose_mode(requested: str | None = None) -> str:
    """"gemv", "onednn" or "torch": `requested`, else $SHARDLM_KERNELS, else the fastest available."""
    mode = requested or os.environ.get("SHARDLM_KERNELS", "auto")
    if mode not in ("auto", "gemv", "onednn", "torch"):
        raise ValueError(f"SHARDLM_KERNELS={mode!r} is not one of auto, gemv, onednn, torch")
    if mode in ("auto", "gemv") and gemv_module() is not None:
        return "gemv"
    if mode in ("auto", "gemv", "onednn") and onednn_available():
        return "onednn"
    return "torch"


def onednn_available() -> bool:
    """True when this torch build has the oneDNN linear ops used here."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def matmul_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ weight^T -> (..., out) with plain weights: the compiled loop for few rows."""
    if _ACTIVE is not None and x.numel() <= GEMV_MAX_ROWS * x.shape[-1] and not x.is_cuda:
        return _ACTIVE.gemv(x, weight)  # (..., out), accumulated in float32
    return F.linear(x, weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ W^T (+ bias) with a oneDNN-packed W -> (..., out)."""
    lead = x.shape[:-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*lead, out_features)  # (..., out)


def local_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ module.weight^T without bias: through the quantized weight (`module.quant`, see
    shardlm.quant) or the packed weight when the module has one."""
    quant = module.__dict__.get("quant")
    if quant is not None:
        return quant.matmul_t(x)
    row_stream = module.__dict__.get("row_stream")  # an LM head used in place from a mapped file
    if row_stream is not None:
        return row_stream(x)
    packed = getattr(module, "packed", None)
    if packed is not None:
        return packed_linear(x, packed, module.out_features, None)
    return matmul_t(x, module.weight)


class FastLinear(nn.Module):
    """A frozen nn.Linear computed by `local_linear` (compiled decode loop or packed oneDNN)."""

    packable = True

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same result as the nn.Linear it replaced (up to summation order)."""
        y = local_linear(self, x)
        return y + self.bias if self.bias is not None else y


def prepare_linears(model: nn.Module, mode: str | None = None) -> str:
    """Route every linear layer of a CPU model through the chosen kernels; returns the mode used.

    In "onednn" mode untied weights are packed in place (the plain copy is dropped); weights
    shared with another module (a tied LM head) stay plain, since packing would hold them twice.
    """
    global _ACTIVE
    mode = choose_mode(mode)
    _ACTIVE = gemv_module() if mode == "gemv" else None  # one mode per process (one rank, one model)
    if mode == "torch":
        return mode
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    names = [name for name, _ in model.named_modules()]  # names only: holding the modules would keep
    for name in names:                                    # every replaced weight alive until the end
        module = model.get_submodule(name) if name else model
        if type(module) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            module = FastLinear(module)
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
        weight = getattr(module, "weight", None)
        if mode == "onednn" and getattr(module, "packable", False) and weight is not None \
                and counts.get(id(weight), 0) == 1 and weight.device.type == "cpu" \
                and not getattr(weight, "_shardlm_mapped", False):  # packing would copy a mapped head into memory
            module.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1),
                                   persistent=False)
            module.out_features = weight.shape[0]
            del module.weight
            module.weight = None
        del module, weight
    return mode
