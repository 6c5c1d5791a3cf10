"""Linear layers for CPU decode: the forms a weight can take, and one function that multiplies by any.

A decode step multiplies every weight matrix by one (or a few) activation rows, so it is bound by
how fast weights stream from memory. Measured on our 2-core machine (fp32, 2 threads, the bundled
model's 210 linear weights; bench/RESULTS.md): `F.linear` (MKL) ~11 GB/s, oneDNN with pre-packed
weights ~14-17 GB/s, and the small row-streaming loop in `csrc/kernels.cpp` ~26 GB/s.

Every linear module shardlm owns (FastLinear, and the tensor-parallel RowParallelLinear and
VocabParallelHead) declares two fields the rank builder sets from outside, once per rank:
- `kernel_weight`: the weight in a kernel's own form, when it is not the plain `weight` parameter:
  quantized codes (shardlm.quant), oneDNN-packed blocks (`OneDNNWeight`), a float weight held apart
  so the offload streamer can swap it (`PlainWeight`), or LM-head rows used in place from a file.
  Each has `matmul_t(x)` and `nbytes()`.
- `gemv`: the compiled kernels when the rank chose them ("gemv" mode), used for inputs of at most
  GEMV_MAX_ROWS rows; larger inputs (prefill) go through `F.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.kernels.build import bf16_units

GEMV_MAX_ROWS = 16
"""Inputs with at most this many rows (decode batches) use the compiled kernel."""


def use_gemv(x: torch.Tensor, gemv) -> bool:
    """Whether `x` goes through the compiled loop: kernels present, a CPU input of at most GEMV_MAX_ROWS rows."""
    return gemv is not None and not x.is_cuda and x.numel() <= GEMV_MAX_ROWS * x.shape[-1]


def prefill_rows(x: torch.Tensor) -> bool:
    """Whether `x` (..., positions, in) holds more than one position a row: a prefill, bound by arithmetic, goes
    through the panel kernels (csrc/qgemm.h for float weights, csrc/qpanel.h for int8 and int4); one position a
    row (decode, any batch) through the kernels that read each weight once (csrc/rows.h, csrc/qrows.h,
    csrc/q4tiles.h). Chosen by the shape of the pass, not by its number of
    rows, so a prompt's tokens meet the same kernel alone or beside other prompts."""
    return x.dim() >= 3 and x.shape[-2] > 1


def _panel_prefill(x: torch.Tensor, weight: torch.Tensor, gemv) -> bool:
    """Whether a plain weight's product goes through the compiled panel kernel: a CPU prefill with a contiguous
    float32 weight, or a bfloat16 one on a CPU without bfloat16 units (with them oneDNN's bfloat16 matmul is
    faster)."""
    if gemv is None or not prefill_rows(x) or x.device.type != "cpu" or weight.device.type != "cpu":
        return False
    if not weight.is_contiguous() or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and not bf16_units())


def matmul_t(x: torch.Tensor, weight: torch.Tensor, gemv=None) -> torch.Tensor:
    """x (..., in) @ weight^T -> (..., out) for a plain weight. With the compiled kernels: a prefill through
    their panel kernel (float32 FMA tiles, each output one chain over `in` in order; about 2x MKL's F.linear for
    512 rows of the bundled model's shapes on an AVX-512 host, 1.05-1.3x for 16; measured), or for a pass of up to
    16 rows the same chains over the weight in place (csrc/fewrows.h), few rows of one position through their row
    loop.
    Otherwise F.linear; many bfloat16 rows on a CPU without bfloat16 units are multiplied in float32 and rounded
    once, which is what the bfloat16 matmul computes too, several times faster there (kernels.build.bf16_units)."""
    if _panel_prefill(x, weight, gemv):
        return gemv.prefill_float(x, weight)  # (..., out) in x's dtype
    if use_gemv(x, gemv):
        return gemv.gemv(x, weight)  # (..., out), accumulated in float32
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu" and not bf16_units():
        return F.linear(x.float(), weight.float()).to(torch.bfloat16)  # (..., out)
    return F.linear(x, weight)


@dataclass
class PlainWeight:
    """A float weight (out, in) held outside the module's parameters, so a streamer can swap `tensor`
    between uses without touching the module."""

    tensor: torch.Tensor
    gemv: object = None
    """The compiled kernels, or None."""

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        return matmul_t(x, self.tensor, self.gemv)

    def nbytes(self) -> int:
        """Bytes held (0 while a streamed layer's tensor is a meta placeholder)."""
        t = self.tensor
        return 0 if t.device.type == "meta" else t.numel() * t.element_size()


@dataclass
class OneDNNWeight:
    """A weight re-laid out once for oneDNN's linear (the plain copy is dropped)."""

    packed: torch.Tensor
    out_features: int

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed, None, "none", [], "")
        return y.view(*lead, self.out_features)  # (..., out)

    def nbytes(self) -> int:
        """Bytes held."""
        return self.packed.numel() * self.packed.element_size()


class LinearOps:
    """The two kernel fields of shardlm's linear modules (see the module docstring)."""

    kernel_weight = None
    """The weight in a kernel's own form, or None: the plain `weight` parameter is used."""
    gemv = None
    """The compiled decode kernels, or None."""


def local_linear(module: nn.Module, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """x @ W^T without bias for a linear module: through its kernel weight when it has one. `wide` asks a
    quantized weight for float64 sums (others ignore it)."""
    kw = module.kernel_weight
    if kw is not None:
        return kw.matmul_t(x, wide=True) if wide and getattr(kw, "wide_sums", False) else kw.matmul_t(x)
    return matmul_t(x, module.weight, module.gemv)


def weight_tensor(module: nn.Module) -> torch.Tensor | None:
    """The plain float weight of a linear module (its parameter, or a PlainWeight's tensor); None when
    the weight is in another form (quantized, packed, mapped rows)."""
    kw = module.kernel_weight
    if kw is None:
        return module.weight
    return kw.tensor if isinstance(kw, PlainWeight) else None


class FastLinear(LinearOps, nn.Module):
    """A frozen nn.Linear computed by `local_linear` (compiled decode loop, packed or quantized weight)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same result as the nn.Linear it replaced (up to summation order)."""
        y = local_linear(self, x)
        return y + self.bias if self.bias is not None else y


def fast_linear(model: nn.Module, name: str) -> nn.Module:
    """The module `name` of `model`, a plain nn.Linear swapped for a FastLinear first."""
    module = model.get_submodule(name)
    if type(module) is nn.Linear:
        parent_name, _, child = name.rpartition(".")
        module = FastLinear(module)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
    return module


def onednn_available() -> bool:
    """True when this torch build has the oneDNN linear ops used here."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def install_linears(model: nn.Module, mode: str, gemv=None, keep: frozenset[int] = frozenset()) -> None:
    """Route every linear layer of a CPU model through `mode`'s kernels ("gemv", "onednn" or "torch").

    Plain nn.Linear modules become FastLinear. "gemv" hands every linear (and every PlainWeight) the
    compiled kernels. "onednn" packs each plain weight used once (a tied LM head stays plain, since
    packing would hold it twice) unless its id is in `keep` (weights used in place from a file).
    """
    if mode == "torch":
        return
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    for name in [n for n, _ in model.named_modules()]:  # names only: holding the modules would keep
        module = fast_linear(model, name) if name else model  # every replaced weight alive until the end
        if not isinstance(module, LinearOps):
            continue
        if mode == "gemv":
            module.gemv = gemv
            if hasattr(module.kernel_weight, "gemv"):  # a PlainWeight, or head rows mapped from a file
                module.kernel_weight.gemv = gemv
            continue
        weight = module.weight
        if module.kernel_weight is None and weight is not None and counts.get(id(weight), 0) == 1 \
                and weight.device.type == "cpu" and id(weight) not in keep:
            module.kernel_weight = OneDNNWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1),
                                                weight.shape[0])
            module.weight = None
