"""Weight-only quantization of linear layers: int8 per output channel, int4 in groups along the input.

Kernels: PyTorch's own weight-only matmuls, `aten._weight_int8pack_mm` (int8 x float, CPU and
CUDA), `aten._weight_int4pack_mm_for_cpu` (tinygemm-style int4, CPU) and `aten._weight_int4pack_mm`
(the tinygemm int4 kernel on CUDA, sm80 and later), the ones torchao's int8/int4 weight-only layouts
dispatched to. The two int4 kernels share the arithmetic (W = (q - 8) * scale + zero, the same
(groups, rows, 2) scale/zero table) and differ only in how the codes are packed, so one set of
codes serves both: `pack_int4` packs them for the device they will run on. We call them directly
rather than through torchao:
torchao 0.18's int4 weight-only has no CPU layout (its plain format needs a CUDA-only library,
plain_int32 refuses CPU tensors; tried on this machine), and importing it tries to load its CUDA
extensions. Using the ops through torch keeps the dependency list as it is and the same code on
every torch in our range.

Quantization parameters are those of the *unsharded* tensor whatever the TP degree:
- int8: scale_o = max_i |W[o, i]| / 127 over the whole row. Column-parallel ranks hold whole
  rows; row-parallel ranks (o_proj, down_proj) hold a column range, so they all-reduce (MAX) the
  row maxima across the TP group before rounding.
- int4: groups of `group` consecutive input columns counted from column 0 of the full tensor,
  asymmetric: W ~ (q - 8) * scale + zero, q in 0..15, with scale = (max - min) / 15 and
  zero = min + 8 * scale. A row-parallel rank whose column range starts or ends inside a group
  reduces that group's min/max across the group (MIN/MAX), then pads its weight with zero columns
  to whole groups and its input with zeros to match, so the kernel sees aligned groups.
So a tp 2 model holds exactly the integers and scales a tp 1 model holds, sliced; only the order
of the final sums differs.

Activations enter the quantized matmuls as bfloat16 (scales and zeros are stored in bfloat16 too),
whatever the model's dtype, and the result is cast back: these CPU kernels have a fast path only
for bfloat16 inputs. Measured here (2 threads, one row, a 4096 x 4096 weight): int8 0.44 ms and
int4 0.46 ms with bfloat16 activations, 7.1 and 14.4 ms with float32 ones, against 1.9 ms for our
float32 decode kernel. Accumulation inside the kernels is float32.

The int8 kernel returns wrong values or crashes when the input width is not a multiple of 32
(torch 2.13, found on this machine with widths 100, 104 and 200), so int8 weights are padded with
zero columns to a multiple of 32, like int4 weights are to whole groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardlm.kernels.linear import use_gemv
from shardlm.quant_spec import INT4_GROUP, INT8_ALIGN

ACT_DTYPE = torch.bfloat16
"""Dtype of the activations, scales and zeros inside the quantized matmuls."""


@dataclass
class Int8Weight:
    """int8 weight (out, in + pad) and one scale per output row (out,) in ACT_DTYPE.

    `pad` zero columns make the width a multiple of INT8_ALIGN (a kernel requirement).
    """

    q: torch.Tensor
    scale: torch.Tensor
    pad: int = 0
    gemv: object = None
    """The compiled kernels (set by the rank builder in "gemv" mode): few rows on the CPU go through their
    int8 loop, which streams the codes once and keeps the activations in float32."""

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) = x @ (q * scale)^T."""
        if use_gemv(x, self.gemv):
            return self.gemv.gemv_int8(x, self.q, self.scale)  # (..., out)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).to(ACT_DTYPE)  # (rows, in)
        if self.pad:
            x2 = F.pad(x2, (0, self.pad))  # (rows, in + pad): zeros meet the zero columns
        y = torch._weight_int8pack_mm(x2.contiguous(), self.q, self.scale)  # (rows, out)
        return y.view(*lead, self.q.shape[0]).to(x.dtype)

    @property
    def in_features(self) -> int:
        """Input width of the weight (without the padding)."""
        return self.q.shape[1] - self.pad

    def nbytes(self) -> int:
        """Bytes held."""
        return self.q.nbytes + self.scale.nbytes



@dataclass
class Int4Weight:
    """Packed int4 weight for the CPU or CUDA kernel, scales and zeros per (group, row), and the padding.

    `pad_left`/`pad_right` zero columns were added so the local columns fall on whole groups;
    `out` real rows of `packed`'s padded row count are kept.
    """

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    group: int
    out: int
    pad_left: int
    pad_right: int
    in_features: int
    """Input width of the weight (without the padding)."""

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).to(ACT_DTYPE)  # (rows, in)
        if self.pad_left or self.pad_right:
            x2 = F.pad(x2, (self.pad_left, self.pad_right))  # (rows, padded in): zeros meet the zero columns
        if self.packed.is_cuda:
            y = torch._weight_int4pack_mm(x2.contiguous(), self.packed, self.group, self.scales_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2.contiguous(), self.packed, self.group, self.scales_zeros)
        if y.shape[-1] != self.out:
            y = y[:, :self.out]  # drop the rows added to reach a multiple of 16
        return y.reshape(*lead, self.out).to(x.dtype)

    def nbytes(self) -> int:
        """Bytes held."""
        return self.packed.nbytes + self.scales_zeros.nbytes


def _reduce(t: torch.Tensor, op, ctx) -> torch.Tensor:
    """Reduce `t` in place over the TP group of `ctx` (a ParallelContext; None or world 1: no-op)."""
    if ctx is not None and ctx.world > 1:
        ctx.all_reduce(t, op)
    return t


def int8_codes(w: torch.Tensor, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 codes (out, in) and float32 scales (out,) of a float weight; `ctx` reduces the
    row maxima across its TP group (for a row-parallel slice)."""
    absmax = _reduce(w.abs().amax(dim=1).float(), dist.ReduceOp.MAX, ctx)  # (out,)
    scale = (absmax / 127).clamp(min=1e-12)
    q = torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (out, in)
    return q, scale


def pack_int8(q: torch.Tensor, scale: torch.Tensor, device: torch.device | str | None = None) -> Int8Weight:
    """An Int8Weight from codes (out, in) and scales (out,), padded for the kernel, on `device`
    (default: where the codes are)."""
    if device is not None:
        q, scale = q.to(device), scale.to(device)
    pad = -q.shape[1] % INT8_ALIGN
    q = F.pad(q, (0, pad)) if pad else q  # (out, in + pad)
    return Int8Weight(q.contiguous(), scale.to(ACT_DTYPE), pad)


def quantize_int8(w: torch.Tensor, ctx=None) -> Int8Weight:  # packed where `w` is
    """Per-row int8 of a float weight (out, in); `ctx` reduces the row maxima across its TP group."""
    return pack_int8(*int8_codes(w, ctx))


def int4_codes(w: torch.Tensor, start: int = 0, total: int | None = None, group_size: int = INT4_GROUP,
               ctx=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Group-wise int4 codes of a float weight (out, in) that holds columns [start, start+in) of `total`.

    Returns codes (out, padded in) int32 in 0..15 over whole groups, float32 scales and zeros
    (out, groups), and the zero columns added on the left and right. Groups are counted from
    column 0 of the full tensor; groups cut by this slice's ends are completed by a MIN/MAX
    reduction over the TP group of `ctx`.
    """
    out, k = w.shape
    total = k if total is None else total
    pad_left = start % group_size
    padded_k = -(-(pad_left + k) // group_size) * group_size
    pad_right = padded_k - pad_left - k
    wf = w.float()
    # (out, padded_k): real columns, +inf/-inf where padded so they never win a min or max
    lo = F.pad(wf, (pad_left, pad_right), value=float("inf")).view(out, -1, group_size).amin(-1)
    hi = F.pad(wf, (pad_left, pad_right), value=float("-inf")).view(out, -1, group_size).amax(-1)
    if ctx is not None and ctx.world > 1:
        g0, n_groups = start // group_size, -(-total // group_size)
        full_lo = torch.full((out, n_groups), float("inf"), device=w.device)
        full_hi = torch.full((out, n_groups), float("-inf"), device=w.device)
        full_lo[:, g0:g0 + lo.shape[1]], full_hi[:, g0:g0 + hi.shape[1]] = lo, hi
        _reduce(full_lo, dist.ReduceOp.MIN, ctx)
        _reduce(full_hi, dist.ReduceOp.MAX, ctx)
        lo, hi = full_lo[:, g0:g0 + lo.shape[1]], full_hi[:, g0:g0 + hi.shape[1]]
    scale = ((hi - lo) / 15).clamp(min=1e-12)  # (out, groups)
    zero = lo + 8 * scale
    x = F.pad(wf, (pad_left, pad_right)).view(out, -1, group_size)  # (out, groups, group)
    q = torch.round((x - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).view(out, padded_k)
    return q, scale, zero, pad_left, pad_right


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, pad_left: int,
              pad_right: int, device: torch.device | str | None = None) -> Int4Weight:
    """An Int4Weight from codes (out, padded in), scales and zeros (out, groups), packed for the
    kernel of `device` (default: where the codes are)."""
    if device is not None:
        q, scale, zero = q.to(device), scale.to(device), zero.to(device)
    out, padded_k = q.shape
    n_pad = -out % 16  # the kernels want a multiple of 16 (CPU) / 8 (CUDA) rows
    q = q.to(torch.int32)
    if n_pad:
        q = F.pad(q, (0, 0, 0, n_pad), value=8)  # rows that decode to `zero`=0 below: harmless, dropped after
        scale, zero = F.pad(scale, (0, 0, 0, n_pad), value=1.0), F.pad(zero, (0, 0, 0, n_pad))
    if q.is_cuda:
        # two codes per byte, even column in the high nibble; tiles of 16 x inner_k_tiles columns
        nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # (rows, padded_k / 2)
        inner = 8 if padded_k % 128 == 0 else 4 if padded_k % 64 == 0 else 2
        packed = torch._convert_weight_to_int4pack(nibbles.contiguous(), inner)
    else:
        packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(ACT_DTYPE).contiguous()  # (groups, rows, 2)
    return Int4Weight(packed, scales_zeros, group_size, out, pad_left, pad_right, padded_k - pad_left - pad_right)


def quantize_int4(w: torch.Tensor, start: int = 0, total: int | None = None,
                  group_size: int = INT4_GROUP, ctx=None) -> Int4Weight:
    """Group-wise int4 of a float weight (out, in) that holds columns [start, start+in) of `total`
    (see int4_codes), ready for the kernel."""
    q, scale, zero, pad_left, pad_right = int4_codes(w, start, total, group_size, ctx)
    return pack_int4(q, scale, zero, group_size, pad_left, pad_right)


def column_range(module: nn.Module) -> tuple[int, int]:
    """(start, total) of the input columns a (possibly row-parallel) linear holds."""
    k = module.weight.shape[1]
    return getattr(module, "in_start", 0), getattr(module, "in_total", k)


def quantize_linear(module: nn.Module, kind: str, ctx=None) -> int:
    """Replace `module.weight` by its quantized form (its `kernel_weight`); returns the bytes now held.

    `ctx` (the rank's ParallelContext) is given when `module` is row-parallel: its row statistics
    span the TP group.
    """
    w = module.weight.detach()
    if kind == "int8":
        qw = quantize_int8(w, ctx)
    else:
        start, total = column_range(module)
        qw = quantize_int4(w, start, total, ctx=ctx)
    module.kernel_weight = qw
    module.weight = None
    return qw.nbytes()


def held_bytes(model: nn.Module, skip: frozenset[int] = frozenset()) -> int:
    """Bytes a model holds in memory: parameters and buffers (each once) and the linear layers' kernel
    weights (quantized, packed, or a streamed layer's current tensors). Tensors on the meta device
    (streamed layers between uses) and those whose id is in `skip` (used in place from a file) are
    not held."""
    seen, total = set(skip), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen and t.device.type != "meta":
            seen.add(id(t))
            total += t.numel() * t.element_size()
    for m in model.modules():
        kw = getattr(m, "kernel_weight", None)
        if kw is not None and id(kw) not in seen:
            seen.add(id(kw))
            tensors = [t for t in vars(kw).values() if isinstance(t, torch.Tensor)]
            if all(t.device.type != "meta" and id(t) not in skip for t in tensors):
                total += kw.nbytes()
    return total
