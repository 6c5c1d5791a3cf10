"""Kernel choices. CPU execution format for linear weights: oneDNN pre-packed matrices.

On this class of machine PyTorch's default `F.linear` for one decode row (an MKL gemv) streams
weights at about 11 GB/s, while the same weights pre-packed for oneDNN stream at about 17 GB/s
(fp32, 2 threads; bench/RESULTS.md). Packing happens once after loading and replaces the plain
weight, so memory does not grow. Weights shared with another module (a tied LM head) stay plain:
packing them would hold the matrix twice.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def packing_available() -> bool:
    """True when this torch build has the oneDNN linear ops used here."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN blocked form of a (out, in) weight, tuned for small batches."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ W^T (+ bias) with a packed W -> (..., out)."""
    lead = x.shape[:-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*lead, out_features)  # (..., out)


class PackedLinear(nn.Module):
    """A frozen nn.Linear whose weight lives in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", pack_weight(linear.weight), persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same result as the nn.Linear it replaced (up to summation order)."""
        return packed_linear(x, self.packed, self.out_features, self.bias)


def local_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ module.weight^T without bias, through the packed weight when the module has one."""
    packed = getattr(module, "packed", None)
    if packed is not None:
        return packed_linear(x, packed, module.out_features, None)
    return F.linear(x, module.weight)


def pack_linears(model: nn.Module) -> int:
    """Pack every untied float linear weight of a CPU model in place; returns how many were packed."""
    if not packing_available():
        log.info("oneDNN packing unavailable in this torch build; using F.linear")
        return 0
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    packed = 0
    names = [name for name, _ in model.named_modules()]  # names only: holding the modules would keep
    for name in names:                                    # every unpacked weight alive until the end
        module = model.get_submodule(name) if name else model
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 2 or counts.get(id(weight), 0) > 1 or weight.device.type != "cpu":
            continue
        if type(module) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, PackedLinear(module))
        elif getattr(module, "packable", False):
            module.register_buffer("packed", pack_weight(weight), persistent=False)
            module.out_features = weight.shape[0]
            del module.weight
            module.weight = None
        else:
            continue
        del module, weight
        packed += 1
    return packed
