"""One matrix product for q, k and v, and one for gate and up, on GPU ranks.

A decode step of batch 1 on a GPU is a chain of small kernels: for Llama-3.2-1B a layer's k and v
projections read 2 MiB each, too little to fill the GPU's memory pipes, and every product is one more
launch. `join_projections` lays each layer's q, k, v weights (and gate, up) end to end in one tensor, so a
step makes one product where it made three (two): the modules' own weights become views of the joined
tensor, so no byte is held twice and the checkpoint names, the memory accounting and every other path see
the same parameters. Attention and MLP use the joined tensor when it is set (models/llama.py).
"""

from __future__ import annotations

import torch
from torch import nn


def _join(modules: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The modules' weights stacked by output rows (out_total, in); their weights become views of it."""
    weight = torch.cat([m.weight.detach() for m in modules])  # (sum of out, in)
    bias = torch.cat([m.bias.detach() for m in modules]) if modules[0].bias is not None else None
    row = 0
    for m in modules:
        n = m.out_features
        m.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return weight, bias


def _joinable(modules: list[nn.Module]) -> bool:
    """Plain float linears on one device with one dtype, biases on all or none (quantized or streamed: no)."""
    if not all(type(m) is nn.Linear for m in modules):
        return False
    first = modules[0].weight
    return all(m.weight.device == first.device and m.weight.dtype == first.dtype and m.weight.is_floating_point()
               and (m.bias is None) == (modules[0].bias is None) for m in modules)


def join_projections(model: nn.Module) -> int:
    """Join q/k/v and gate/up of every decoder layer of `model` where they are plain float linears; returns
    how many layers were joined."""
    joined = 0
    for layer in model.model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        if not (_joinable(qkv) and _joinable(gate_up)):
            continue
        attn.qkv_weight, attn.qkv_bias = _join(qkv)
        attn.qkv_split = [m.out_features for m in qkv]
        mlp.gate_up_weight, mlp.gate_up_bias = _join(gate_up)
        joined += 1
    return joined
