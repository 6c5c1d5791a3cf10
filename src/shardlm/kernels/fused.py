"""Fused CPU decode of a Llama block: each half of the block in one compiled call (csrc/decode.h).

A block decoding one new token per row used to run ~45 small torch ops; at batch 1 their dispatch
cost about as much as streaming the weights. When the compiled kernels are chosen ("gemv" mode),
the model is float32 or bfloat16 on CPU and the block's seven linear weights are plain (not
oneDNN-packed) or all int8 or all int4 (the kernels quantize each input row in blocks of 32 and use
integer dot products, csrc/qrows.h), the rank builder installs a `FusedDecode` as the block's
`decode_step`, and a decode step runs the block as two calls: the attention half (norm, q/k/v,
rotary, cache write, attention, o projection) and the MLP half (norm, gate/up, SiLU gating, down
projection). On one rank each call also adds the residual; under tensor parallelism the o and down
projections are row-parallel (`RowParallelLinear`), so each call returns this rank's partial sums
and the all-reduce, the bias and the residual follow here. Offloaded layers work unchanged: their
weights are `PlainWeight`s the streamer fills around the block's forward, read here at each call.
In bfloat16 the arithmetic inside each call is float32 and only the cache and each half's output
are rounded to bfloat16 (the module path rounds after every op), so the two paths differ by
bfloat16 rounding, not more. Everything else (prefill, float16, CUDA) takes the
module-by-module path, which is also the reference the fused path is tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from shardlm.kernels.linear import GEMV_MAX_ROWS, weight_tensor
from shardlm.quant import Int4Weight, Int8Weight

DTYPES = (torch.float32, torch.bfloat16)
"""Model dtypes the fused step runs (arithmetic in float32; cache and outputs in the model's dtype)."""


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _weights(layer: nn.Module, dtype: torch.dtype) -> tuple[list, list | None, list | None] | None:
    """The block's seven weights as the kernels take them: plain `dtype` tensors (scales and pads None); int8
    codes with their row scales and pads (0, code_order); or int4 codes with
    their (scale, zero) tables and (left padding, rows). None when they are in another form (packed, on CUDA,
    mixed) or a norm is not `dtype`."""
    linears = _linears(layer)
    if any(n.dtype != dtype for n in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)):
        return None
    plain = [weight_tensor(m) for m in linears]
    if all(w is not None and w.dtype == dtype for w in plain):
        return plain, None, None
    codes = [m.kernel_weight for m in linears]
    # "meta": a streamed layer between uses (the streamer puts CPU tensors back before each call)
    if all(isinstance(kw, Int8Weight) and kw.q.device.type in ("cpu", "meta") for kw in codes):
        return [kw.q for kw in codes], [kw.scale for kw in codes], [(0, code_order(kw)) for kw in codes]
    if all(isinstance(kw, Int4Weight) and kw.packed.device.type in ("cpu", "meta") for kw in codes):
        return [kw.packed for kw in codes], [kw.scales_zeros for kw in codes], [(kw.pad_left, kw.out) for kw in codes]
    return None


def code_order(kw: Int8Weight) -> int:
    """How csrc/decode.h's linear_of names an int8 weight's column order: 0 natural, 1 interleaved, 2 paired."""
    return 1 if kw.interleaved else 2 if kw.paired else 0


def plain_block(layer: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the kernels can read every linear weight and norm of a block: plain tensors of `dtype`, or
    int8 or int4 codes beside norms of `dtype`."""
    return _weights(layer, dtype) is not None


def _finish(x: torch.Tensor, partial: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """(all_reduce(partial) + x) + bias, for a row-parallel projection's partial sums (b, dim). Quantized weights'
    sums come in float64 and are finished in float32 as the one-rank kernel finishes them (csrc/decode.h)."""
    if partial.dtype == torch.float64:
        y = proj.ctx.all_reduce(partial).float().add_(x.float())
        y = y.add_(proj.bias.float()) if proj.bias is not None else y
        return y.to(x.dtype)
    y = proj.ctx.all_reduce(partial).add_(x)
    return y.add_(proj.bias) if proj.bias is not None else y


class FusedDecode:
    """The fused decode step of one block in `dtype`, installed as `layer.decode_step` by the rank builder.
    `fixed`: the block's tensors never change (nothing streams on this rank), so they are looked up once, not at
    every call (the lookups cost about a millisecond a token over 30 blocks, measured)."""

    def __init__(self, ops, dtype: torch.dtype, fixed: bool = False):
        self.ops, self.dtype, self.fixed = ops, dtype, fixed
        self._parts: tuple | None = None

    def _block(self, layer: nn.Module) -> tuple:
        """(linears, (weights, scales, pads)) of `layer`, read now unless fixed and read before."""
        if self._parts is not None:
            return self._parts
        parts = _linears(layer), _weights(layer, self.dtype)  # a streamed layer's tensors change between calls
        if self.fixed:
            self._parts = parts
        return parts

    def applies(self, x: torch.Tensor, mask: torch.Tensor, cache) -> bool:
        """Whether this call can run fused: one new token per row, few rows, on the CPU in this dtype, with a
        cache that gives the kernel its rows and positions (`fused_target`)."""
        return cache is not None and x.shape[1] == 1 and x.dtype == self.dtype and x.device.type == "cpu" \
            and x.shape[0] <= GEMV_MAX_ROWS and mask.dtype == torch.bool and mask.shape[-1] == cache.offset + 1 \
            and hasattr(cache, "fused_target")

    def __call__(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 cache) -> torch.Tensor | None:
        """One block for one new token per row: x (b, 1, dim) -> (b, 1, dim), writing the layer's cache slot;
        None when the call does not apply (the block then runs module by module).

        cos/sin (b, 1, 1, hd) and mask (b, 1, 1, offset+1) as the module path takes them.
        """
        if not self.applies(x, mask, cache):
            return None
        attn, mlp = layer.self_attn, layer.mlp
        b, _, dim = x.shape
        cache.check_room(1)
        (q, k, v, o, gate, up, down), (weights, scales, pads) = self._block(layer)
        o_split = hasattr(o, "ctx")  # row-parallel: partial sums to all-reduce
        norm = layer.input_layernorm
        x = x.reshape(b, dim)
        kc, vc, rows, positions = cache.fused_target(attn.layer_id)  # the kernel writes row j at its position
        h = self.ops.attn_decode(x, norm.weight, norm.eps, weights[:4], scales and scales[:4], q.bias, k.bias, v.bias,
                                 cos.reshape(b, -1), sin.reshape(b, -1), kc, vc, rows, positions, attn.kv_map,
                                 mask.reshape(b, -1), o.bias, not o_split, pads and pads[:4])  # (b, dim)
        if o_split:
            h = _finish(x, h, o)
        down_split = hasattr(down, "ctx")
        norm = layer.post_attention_layernorm
        out = self.ops.mlp_decode(h, norm.weight, norm.eps, weights[4:], scales and scales[4:], gate.bias, up.bias,
                                  down.bias, not down_split, pads and pads[4:])  # (b, dim)
        if down_split:
            out = _finish(h, out, down)
        return out.view(b, 1, dim)


def install_fused(model: nn.Module, ops, dtype: torch.dtype, fixed: bool = False) -> int:
    """Give every block of `model` the compiled prefill attention, and those whose weights are plain `dtype`
    tensors a FusedDecode step (`fixed`: no layer streams, so each step may keep its block's tensors); returns how
    many blocks got a step (0 when `ops` is None or `dtype` is not one the kernels run). Where every block got
    one, none streams and no projection is split across ranks (tensor parallel 1), the model also gets a
    FusedStack: the whole step in one call."""
    if ops is None or dtype not in DTYPES:
        return 0
    installed = 0
    layers = list(model.model.layers.values())
    for layer in layers:
        layer.self_attn.prefill_attention = ops.prefill_attention
        if plain_block(layer, dtype):
            layer.decode_step = FusedDecode(ops, dtype, fixed)
            installed += 1
    one_rank = not any(hasattr(layer.self_attn.o_proj, "ctx") or hasattr(layer.mlp.down_proj, "ctx")
                       for layer in layers)
    if fixed and layers and installed == len(layers) and one_rank and hasattr(ops, "DecodeStack"):
        model.decode_stack = FusedStack(ops, dtype, layers)
    return installed


class FusedStack:
    """Every block of a one-rank model in one compiled call per decode step (csrc/stack.h), installed as
    `model.decode_stack`: the same two fused halves per block as FusedDecode, in the same order, without the 60
    crossings from Python a step of 30 blocks made (about a third of an int4 batch-1 step, measured). It applies
    when every block's step is still the FusedDecode it was built with and that step applies to the call. The
    kernel object holds each block's weights, norms and KV map (rebuilt if a layer's KV map is replaced); the KV
    caches are passed at each call, so a finished run's cache is freed with the run."""

    def __init__(self, ops, dtype: torch.dtype, layers: list[nn.Module]):
        self.ops, self.dtype, self.layers = ops, dtype, layers
        self.steps = [layer.decode_step for layer in layers]
        self.ids = [layer.self_attn.layer_id for layer in layers]
        self._buffers = [layer.self_attn._buffers for layer in layers]
        """Each block's attention buffers, where its kv_map is (read per step without nn.Module's attribute
        lookup: 60 of them a step had cost ~1 % of an int4 batch-1 step, py-spy)."""
        self._kernel = None
        self._maps: list[torch.Tensor] = []

    def _build(self) -> None:
        weights, scales, pads, biases, norms, eps = [], [], [], [], [], []
        for layer in self.layers:
            w, sc, pd = _weights(layer, self.dtype)
            weights.append(w), scales.append(sc), pads.append(pd)
            biases.append([m.bias for m in _linears(layer)])
            a, b = layer.input_layernorm, layer.post_attention_layernorm
            norms.append((a.weight, b.weight)), eps.append((a.eps, b.eps))
        self._maps = [b.get("kv_map") for b in self._buffers]
        self._kernel = self.ops.DecodeStack(weights, scales, pads, biases, norms, eps, self._maps)

    def current(self):
        """The compiled stack, built (or rebuilt for a replaced KV map) as the blocks stand now; None when a block's
        fused step was replaced (the blocks then run one by one)."""
        if any(layer.decode_step is not step for layer, step in zip(self.layers, self.steps)):
            return None
        if self._kernel is None or any(b.get("kv_map") is not m for b, m in zip(self._buffers, self._maps)):
            self._build()
        return self._kernel

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 cache) -> torch.Tensor | None:
        """x (b, 1, dim) through every block -> (b, 1, dim), writing each layer's cache; None when the call does
        not apply (the blocks then run one by one). Arguments as FusedDecode takes them."""
        if not hasattr(cache, "k") or not self.steps[0].applies(x, mask, cache) or self.current() is None:
            return None
        cache.check_room(1)
        b, _, dim = x.shape
        _, _, rows, positions = cache.fused_target(self.ids[0])  # the kernel writes row j at its position
        caches = [(cache.k[i], cache.v[i]) for i in self.ids]
        out = self._kernel.step(x.reshape(b, dim), cos.reshape(b, -1), sin.reshape(b, -1), rows, positions,
                                mask.reshape(b, -1), caches)  # (b, dim)
        return out.view(b, 1, dim)
