"""Weight-only quantization of linear layers: int8 per output channel, int4 in groups along the input.

Kernels. On the CPU, our own, through the compiled kernels. Decode (one position a row, csrc/qrows.h and
q4tiles.h): each input row is quantized to int16 in blocks of 32 and meets the int8 or int4 codes in the CPU's
integer units, so codes are never widened to float and are read once; int4 codes are stored in row tiles of 16
that both the decode products and the prefill panels read (`pack_int4`).
Prefill (csrc/qpanel.h, `kernels.linear.prefill_rows`): the input rows are quantized as in decode, and panels of
16 weight rows (32 with AVX-512) are widened to int16 pairs once per call and meet them in integer register tiles
(VNNI's dot products where the CPU has them), one chain of block terms per output: int4 prefill gives decode's
numbers bit for bit, int8's o and down projections decode's but for double sums in another order (about 2^-29 a
value). The o and down projections (`exact`) sum in double (one term a block of 32 columns) so that
tensor-parallel partial sums add up to the one-rank result bit for bit; a CPU rank holds their codes interleaved
(`Int8Weight.interleave`, csrc/qexact.h), the order in which those sums need no horizontal reduction, and the
others' codes paired (`Int8Weight.pair`, csrc/qpairs.h), a pair of blocks' halves side by side, the order in which
a 512-bit build sums two blocks with one multiply-add. Neither order changes a number.
Without the compiled kernels, int8 goes through PyTorch's `aten._weight_int8pack_mm` (bfloat16 activations) and
int4 is dequantized per product. On CUDA, PyTorch's `_weight_int8pack_mm` and the tinygemm int4 kernel
`aten._weight_int4pack_mm` (sm80 and later), the ones torchao's weight-only layouts dispatch to. We call them
directly rather than through torchao: torchao 0.18's int4 weight-only has no CPU layout (its plain format needs a
CUDA-only library, plain_int32 refuses CPU tensors; tried on this machine), and importing it tries to load its CUDA
extensions.

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

Scales and zeros are stored in bfloat16. PyTorch's kernels take bfloat16 activations (their only fast path
on the CPU) and the result is cast back; accumulation inside every kernel is float32 (int32 inside a block
of 32 in ours).

PyTorch's int8 kernel returns wrong values or crashes when the input width is not a multiple of 32
(torch 2.13, found on this machine with widths 100, 104 and 200), so int8 weights are padded with
zero columns to a multiple of 32, like int4 weights are to whole groups (ours needs it too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardlm.kernels.linear import prefill_rows
from shardlm.quant_spec import INT4_GROUP, INT8_ALIGN

ACT_DTYPE = torch.bfloat16
"""Dtype of the activations, scales and zeros inside the quantized matmuls."""


@dataclass
class Int8Weight:
    """int8 weight (out, in + pad) and one scale per output row (out,): bfloat16 values, held as float32 on the CPU
    (what our kernels read, so no step converts them) and as ACT_DTYPE on CUDA (what torch's kernel takes).

    `pad` zero columns make the width a multiple of INT8_ALIGN (a kernel requirement).
    """

    q: torch.Tensor
    scale: torch.Tensor
    pad: int = 0
    gemv: object = None
    """The compiled kernels (set by the rank builder in "gemv" mode): every CPU product goes through their int8
    loop (integer dot products on block-quantized inputs, sums in double)."""
    exact: bool = False
    """A weight whose rows tensor parallelism splits by input column (o_proj, down_proj; set by the rank builder at
    any tp): our kernel sums its rows in double, so that split sums add up to the whole bit for bit."""
    interleaved: bool = False
    """`q` in the exact kernels' interleaved order (csrc/qexact.h; `interleave`), where the rank builder put it."""
    paired: bool = False
    """`q` in the float-summed kernels' paired order (csrc/qpairs.h; `pair`), where the rank builder put it."""
    wide_sums = True
    """`matmul_t(x, wide=True)` can return float64 partial sums (see RowParallelLinear)."""

    def matmul_t(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        """x (..., in) -> (..., out) = x @ (q * scale)^T; `wide`: float64 when our kernel runs (else x's dtype)."""
        if self.gemv is not None and not x.is_cuda:
            kernel = self.gemv.prefill_int8 if prefill_rows(x) else self.gemv.gemv_int8
            return kernel(x, self.q, self.scale, self.exact, wide, self.interleaved, self.paired)  # (..., out)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).to(ACT_DTYPE)  # (rows, in)
        if self.pad:
            x2 = F.pad(x2, (0, self.pad))  # (rows, in + pad): zeros meet the zero columns
        y = torch._weight_int8pack_mm(x2.contiguous(), self.natural_q(), self.scale.to(ACT_DTYPE))  # (rows, out)
        return y.view(*lead, self.q.shape[0]).to(x.dtype)

    def interleave(self) -> None:
        """Put the codes of an `exact` CPU weight in the interleaved order its kernel reads fastest (in place)."""
        if self.interleaved or self.q.is_cuda or not self.exact:
            raise ValueError("only an exact int8 weight on the CPU, not yet interleaved, can be interleaved")
        self.q, self.interleaved = interleave_columns(self.q), True

    def pair(self) -> None:
        """Put the codes of a CPU weight summed in float lanes (not `exact`) in the paired order its kernel reads
        fastest (in place)."""
        if self.paired or self.interleaved or self.q.is_cuda or self.exact:
            raise ValueError("only an int8 weight on the CPU summed in float lanes (not exact), not yet paired, can "
                             "be paired")
        self.q, self.paired = pair_columns(self.q), True

    def natural_q(self) -> torch.Tensor:
        """The codes (out, in + pad) in their natural column order."""
        return self.natural_rows(slice(None))

    def natural_rows(self, index) -> torch.Tensor:
        """Rows `index` of the codes (an index tensor or a slice), in their natural column order."""
        rows = self.q[index]
        if self.interleaved:
            return interleave_columns(rows.reshape(-1, rows.shape[-1])).view(rows.shape)
        if self.paired:
            return pair_columns(rows.reshape(-1, rows.shape[-1])).view(rows.shape)
        return rows

    @property
    def in_features(self) -> int:
        """Input width of the weight (without the padding)."""
        return self.q.shape[1] - self.pad

    def nbytes(self) -> int:
        """Bytes held."""
        return self.q.nbytes + self.scale.nbytes



@dataclass
class Int4Weight:
    """int4 codes, scales and zeros in the layout of the device's kernel, and the padding.

    CPU (csrc/q4tiles.h, any number of rows): rows in tiles of 16 (the last padded with zero rows), each
    tile's codes group by group: `packed` (tiles, groups, 256) uint8, where line m (64 bytes) of a group holds
    row i's columns 4m + b (b = 0..3) in the low nibbles of its bytes 4i + b and columns 16 + 4m + b in their
    high nibbles; `scales_zeros` (tiles, groups, 32), the tile's 16 scales then its 16 zeros. CUDA (torch's tinygemm
    kernel): `packed` in its tiled layout over a multiple of 16 rows, `scales_zeros` (groups, rows, 2).
    `pad_left`/`pad_right` zero columns were added so the local columns fall on whole groups; `out` real rows are
    kept.
    """

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    group: int
    out: int
    pad_left: int
    pad_right: int
    in_features: int
    """Input width of the weight (without the padding)."""
    gemv: object = None
    """The compiled kernels (set by the rank builder in "gemv" mode): every CPU product goes through their int4
    loop; without them the weight is dequantized for each product (slow, but every kernel mode runs)."""
    exact: bool = False
    """Rows split by input column under tensor parallelism: summed in double (see Int8Weight.exact)."""
    wide_sums = True
    """`matmul_t(x, wide=True)` can return float64 partial sums (see RowParallelLinear)."""

    def matmul_t(self, x: torch.Tensor, wide: bool = False) -> torch.Tensor:
        """x (..., in) -> (..., out); `wide`: float64 when our kernel runs (else x's dtype)."""
        if not self.packed.is_cuda:
            if self.gemv is not None:
                kernel = self.gemv.prefill_int4 if prefill_rows(x) else self.gemv.gemm_int4
                return kernel(x, *self.kernel_args(), self.exact, wide)  # (..., out)
            return F.linear(x, self.dequantized().to(x.dtype))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).to(ACT_DTYPE)  # (rows, in)
        if self.pad_left or self.pad_right:
            x2 = F.pad(x2, (self.pad_left, self.pad_right))  # (rows, padded in): zeros meet the zero columns
        y = torch._weight_int4pack_mm(x2.contiguous(), self.packed, self.group, self.scales_zeros)
        if y.shape[-1] != self.out:
            y = y[:, :self.out]  # drop the rows added to reach a multiple of 16
        return y.reshape(*lead, self.out).to(x.dtype)

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(codes, scales and zeros, pad_left, rows): what the compiled int4 products take after x."""
        return self.packed, self.scales_zeros, self.pad_left, self.out

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The CPU layout unpacked: codes (out, padded in) uint8 in 0..15, scales and zeros (out, groups) float32."""
        tiles, groups, _ = self.packed.shape
        lines = self.packed.view(tiles, groups, CPU_TILE_LINES, CPU_TILE, 4)  # (tiles, groups, line, row, byte)
        # low nibbles: columns 4m + b (the group's first 16), high: 16 + 4m + b; (tiles, groups, row, 16) each
        low = (lines & 15).permute(0, 1, 3, 2, 4).reshape(tiles, groups, CPU_TILE, 16)
        high = (lines >> 4).permute(0, 1, 3, 2, 4).reshape(tiles, groups, CPU_TILE, 16)
        # (tiles, groups, row, 32) -> (tiles, row, groups, 32) -> (rows, padded in)
        codes = torch.cat([low, high], dim=-1).permute(0, 2, 1, 3).reshape(tiles * CPU_TILE, groups * self.group)
        sz = self.scales_zeros.float().view(tiles, groups, 2, CPU_TILE).permute(2, 0, 3, 1)  # (2, tiles, row, groups)
        scale, zero = sz.reshape(2, tiles * CPU_TILE, groups)
        return codes[:self.out], scale[:self.out], zero[:self.out]

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (out, in) a CPU Int4Weight stands for."""
        codes, scale, zero = self.codes()
        groups = scale.shape[1]
        w = (codes.view(self.out, groups, self.group).float() - 8) * scale[..., None] + zero[..., None]  # (out, groups, group)
        return w.view(self.out, -1)[:, self.pad_left:self.pad_left + self.in_features]

    def nbytes(self) -> int:
        """Bytes held."""
        return self.packed.nbytes + self.scales_zeros.nbytes


def _reduce(t: torch.Tensor, op, ctx) -> torch.Tensor:
    """Reduce `t` in place over the TP group of `ctx` (a ParallelContext; None or world 1: no-op)."""
    if ctx is not None and ctx.world > 1:
        ctx.all_reduce(t, op)
    return t


INTERLEAVE_BLOCKS = 16
"""Blocks of 32 columns in one interleaved group (csrc/qexact.h's IGROUP_BLOCKS)."""


def interleave_groups(blocks: int) -> list[tuple[int, int]]:
    """(first block, m) of each group of a row of `blocks` blocks in csrc/qexact.h's interleaved order: whole groups
    of 16 from block 0, then the tail's blocks in groups of 8, 4 and 2 where its count has that bit, then a last odd
    block alone (m = 1, nothing moves)."""
    whole = blocks // INTERLEAVE_BLOCKS * INTERLEAVE_BLOCKS
    groups = [(g, INTERLEAVE_BLOCKS) for g in range(0, whole, INTERLEAVE_BLOCKS)]
    first, m = whole, INTERLEAVE_BLOCKS // 2
    while m >= 1:
        if blocks - first >= m:
            groups.append((first, m))
            first += m
        m //= 2
    return groups


def interleave_columns(q: torch.Tensor) -> torch.Tensor:
    """int8 codes (out, kp), kp a multiple of 32, in csrc/qexact.h's interleaved order: in each group of m blocks
    (interleave_groups), chunk t of block l (16 / m column pairs) moves to chunk position t m + l, an m x m transpose
    of chunks (with m = 16, pair i of block l at pair position 16 i + l). The transpose is its own inverse, so this
    also turns them back."""
    out = q.shape[0]
    parts = []
    for first, m in interleave_groups(q.shape[1] // 32):
        group = q[:, 32 * first:32 * (first + m)].reshape(out, m, m, 32 // m)  # (out, block l, chunk t, 2 * 16 / m)
        parts.append(group.transpose(1, 2).reshape(out, 32 * m))  # (out, chunk t, block l, ...) -> (out, 32 m)
    return torch.cat(parts, dim=1).contiguous() if parts else q.clone()  # (out, kp)


def pair_columns(q: torch.Tensor) -> torch.Tensor:
    """int8 codes (out, kp), kp a multiple of 32, in csrc/qpairs.h's paired order: in each whole pair of blocks (64
    columns from column 0) the 16-column halves [A 0-15, A 16-31, B 0-15, B 16-31] become [A 0-15, B 0-15, A 16-31,
    B 16-31]; an odd last block stays. The exchange is its own inverse, so this also turns them back."""
    out, kp = q.shape
    whole = kp // 64 * 64
    pairs = q[:, :whole].reshape(out, whole // 64, 2, 2, 16)  # (out, pair, block, half, 16)
    return torch.cat([pairs.transpose(2, 3).reshape(out, whole), q[:, whole:]], dim=1).contiguous()  # (out, kp)


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
    scale = scale.to(ACT_DTYPE)  # the stored precision on every device
    return Int8Weight(q.contiguous(), scale if q.is_cuda else scale.float(), pad)


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


CPU_TILE = 16
"""Rows of an int4 weight the CPU layout interleaves (csrc/q4tiles.h)."""
CPU_TILE_LINES = 4
"""64-byte lines a (tile, group of 32 columns) holds."""


def _cpu_tiles(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (out, padded in) and scales/zeros (out, groups) in the CPU's row tiles (see Int4Weight): codes
    (tiles, groups, 256) uint8, scales and zeros (tiles, groups, 32) bfloat16."""
    if group_size != 32:
        raise ValueError(f"the CPU int4 kernels take groups of 32 columns, not {group_size}; quantize with group 32")
    out, padded_k = q.shape
    tiles, groups = -(-out // CPU_TILE), padded_k // group_size
    extra = tiles * CPU_TILE - out  # zero rows completing the last tile (scale and zero 0: they decode to 0)
    q8 = F.pad(q.to(torch.uint8), (0, 0, 0, extra))
    scale, zero = F.pad(scale.float(), (0, 0, 0, extra)), F.pad(zero.float(), (0, 0, 0, extra))
    # (rows, padded in) -> (tiles, row, groups, 32) -> (tiles, groups, row, 32)
    t = q8.view(tiles, CPU_TILE, groups, group_size).permute(0, 2, 1, 3)
    # columns 4m + b (the group's first 16) and 16 + 4m + b: (tiles, groups, row, line m, b)
    low = t[..., :16].reshape(tiles, groups, CPU_TILE, CPU_TILE_LINES, 4)
    high = t[..., 16:].reshape(tiles, groups, CPU_TILE, CPU_TILE_LINES, 4)
    # byte 4i + b of line m: (tiles, groups, line, row, b) -> (tiles, groups, 256)
    packed = (low | high << 4).permute(0, 1, 3, 2, 4).reshape(tiles, groups, CPU_TILE * group_size // 2)
    # (rows, groups) -> (tiles, groups, 16) for scales and zeros, side by side: (tiles, groups, 32)
    sz = torch.cat([v.view(tiles, CPU_TILE, groups).transpose(1, 2) for v in (scale, zero)], dim=-1)
    return packed.contiguous(), sz.to(ACT_DTYPE).contiguous()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, pad_left: int,
              pad_right: int, device: torch.device | str | None = None) -> Int4Weight:
    """An Int4Weight from codes (out, padded in), scales and zeros (out, groups), packed for the
    kernel of `device` (default: where the codes are)."""
    if device is not None:
        q, scale, zero = q.to(device), scale.to(device), zero.to(device)
    out, padded_k = q.shape
    in_features = padded_k - pad_left - pad_right
    if not q.is_cuda:
        packed, scales_zeros = _cpu_tiles(q, scale, zero, group_size)
        return Int4Weight(packed, scales_zeros, group_size, out, pad_left, pad_right, in_features)
    n_pad = -out % 16  # the CUDA kernel wants a multiple of 8 rows; 16 keeps one rule
    q = q.to(torch.int32)
    if n_pad:
        q = F.pad(q, (0, 0, 0, n_pad), value=8)  # rows that decode to `zero`=0 below: harmless, dropped after
        scale, zero = F.pad(scale, (0, 0, 0, n_pad), value=1.0), F.pad(zero, (0, 0, 0, n_pad))
    # two codes per byte, even column in the high nibble; tiles of 16 x inner_k_tiles columns
    nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # (rows, padded_k / 2)
    inner = 8 if padded_k % 128 == 0 else 4 if padded_k % 64 == 0 else 2
    packed = torch._convert_weight_to_int4pack(nibbles.contiguous(), inner)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(ACT_DTYPE).contiguous()  # (groups, rows, 2)
    return Int4Weight(packed, scales_zeros, group_size, out, pad_left, pad_right, in_features)


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


class Int8Embedding(nn.Module):
    """A token embedding held as int8 codes with a scale per row (`--quantize-embedding`): a lookup multiplies
    the rows' codes by their scales, in float32, then rounds to `dtype`. The codes are an Int8Weight, so an LM head
    tied to the embedding multiplies by the very same tensor through the int8 kernel.

    Under tensor parallelism the rows are the rank's vocabulary slice [start, stop): ids outside it give zeros and
    the all-reduce of `ctx` sums every token's row from the rank that owns it, as VocabParallelEmbedding does.
    """

    def __init__(self, codes: Int8Weight, dtype: torch.dtype, start: int = 0, stop: int | None = None, ctx=None):
        super().__init__()
        self.kernel_weight, self.dtype, self.ctx = codes, dtype, ctx
        self.start, self.stop = start, codes.q.shape[0] if stop is None else stop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (b, s) -> (b, s, dim) in `dtype`."""
        kw = self.kernel_weight
        if self.ctx is None and self.start == 0:  # the whole vocabulary here: the same rows, fewer ops a step
            codes = kw.natural_rows(ids)[..., :kw.in_features]  # (b, s, dim) int8
            return (codes.float() * kw.scale[ids].float().unsqueeze(-1)).to(self.dtype)  # (b, s, dim)
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        codes = kw.natural_rows(local)[..., :kw.in_features]  # (b, s, dim) int8
        out = (codes.float() * kw.scale[local].float().unsqueeze(-1)).to(self.dtype)  # (b, s, dim)
        if self.ctx is None:
            return out
        return self.ctx.all_reduce(out * mine.unsqueeze(-1).to(self.dtype))


def quantize_embedding(embedding: nn.Module, dtype: torch.dtype) -> Int8Embedding:
    """The Int8Embedding of a loaded embedding (nn.Embedding, or a VocabParallelEmbedding with its slice and
    group): per-row int8 over whole rows, so every layout holds the same codes for a token."""
    codes = quantize_int8(embedding.weight.detach())
    return Int8Embedding(codes, dtype, getattr(embedding, "start", 0), getattr(embedding, "stop", None),
                         getattr(embedding, "ctx", None))
