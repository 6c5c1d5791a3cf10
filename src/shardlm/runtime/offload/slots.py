"""Where a streamed layer's weights live while it is away, and how they are put back.

A streamed layer's linear weights are held apart from its modules, as kernel weights
(`kernels.linear.PlainWeight` for float weights, the quantized forms of shardlm.quant): the streamer
swaps the tensors inside those objects, never the modules' parameters. Norms and biases are small
and stay resident (the planner counts them so: `plan.memory.ShardWeights.layer_fixed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardlm.kernels.linear import LinearOps, PlainWeight, fast_linear


@dataclass
class Slot:
    """One tensor of a streamed layer: where it lives in the layer's extent and which object holds it."""

    owner: object
    """The kernel weight (PlainWeight, Int8Weight, Int4Weight) whose field the tensor is."""
    attr: str
    """The field name."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    """Byte offset inside the layer's extent."""
    nbytes: int

    def __post_init__(self):
        self.placeholder = torch.empty(self.shape, dtype=self.dtype, device="meta")
        """What the field holds while the layer is away."""


@dataclass
class LayerExtent:
    """A streamed layer: its slots and its byte range in the scratch file (or its pinned block)."""

    slots: list[Slot]
    offset: int
    nbytes: int


def hold_apart(layer: nn.Module) -> None:
    """Move every float linear weight of `layer` into a PlainWeight (nn.Linear becomes FastLinear), so a
    streamer can swap it; quantized weights are already held apart."""
    for name in [n for n, m in layer.named_modules() if type(m) is nn.Linear or isinstance(m, LinearOps)]:
        module = fast_linear(layer, name)
        if module.kernel_weight is None and module.weight is not None:
            module.kernel_weight = PlainWeight(module.weight.detach())
            module.weight = None


def layer_tensors(layer: nn.Module) -> list[tuple[object, str, torch.Tensor]]:
    """(kernel weight, field, tensor) for every linear weight tensor of a layer held apart."""
    out: list[tuple[object, str, torch.Tensor]] = []
    for module in layer.modules():
        kw = getattr(module, "kernel_weight", None) if isinstance(module, LinearOps) else None
        if kw is not None:
            out.extend((kw, name, t) for name, t in vars(kw).items() if isinstance(t, torch.Tensor))
    return out


def slots_of(layer: nn.Module, align: int) -> tuple[list[tuple[torch.Tensor, Slot]], int]:
    """Each weight tensor of `layer` with its slot in one block (largest elements first, each start
    aligned to `align` bytes), and the block's size."""
    items = sorted(layer_tensors(layer), key=lambda it: -it[2].element_size())
    out, pos = [], 0
    for owner, attr, t in items:
        pos = -(-pos // align) * align
        nbytes = t.numel() * t.element_size()
        out.append((t, Slot(owner, attr, tuple(t.shape), t.dtype, pos, nbytes)))
        pos += nbytes
    return out, pos


def attach(slots: list[Slot], base: torch.Tensor) -> None:
    """Point every slot's field at its bytes in `base` (uint8, the layer's extent): views, no copy."""
    for s in slots:
        setattr(s.owner, s.attr, base[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape))


def detach(slots: list[Slot]) -> None:
    """Put the meta placeholders back: the layer holds nothing until it is attached again."""
    for s in slots:
        setattr(s.owner, s.attr, s.placeholder)
