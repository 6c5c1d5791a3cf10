"""Batch-1 decode products on a GPU as Triton GEMV kernels, with the block's norms, gating and residual adds inside.

A compiled Llama-3.2-1B decode step on an H200 spent 922 of its 1095 us in Inductor's fused reductions, the
products (bench/RESULTS.md, 2026-11-26 23:00): the 525 MB LM head ran at 4.5 TB/s, the layers' small products far
below it. At one row a product is a matrix-vector product: every weight byte is read once, so its time is bytes over
bandwidth plus the launch, and what matters is how many bytes each program keeps in flight. `gemv` reads a block of
BLOCK_N weight rows a program, BLOCK_K columns a load, and folds in what sits around a decoder block's products:

- `norm_weight`: the input is RMS-normalized first (x * rsqrt(mean(x^2) + eps) in float32, rounded to the dtype,
  times the norm weight, rounded again: `models.llama.RMSNorm`'s arithmetic), each program recomputing the sum of
  squares from the input (a few KiB, in L2), so the norm costs no launch;
- `silu`: the input is a joined gate/up output (2K,), and the product reads silu(gate) * up (each rounded to the
  dtype as torch rounds them), so the gating costs no launch;
- `residual`: the output is residual + product (the product rounded to the dtype first, as `x + module(x)` rounds).

Sums are float32 over each row's K in a fixed order, so a row's result does not depend on anything but its inputs.
`install_gemv_blocks` puts it in the decoder blocks of a one-GPU rank (SHARDLM_CUDA_GEMV=1): each block's four
products become four launches, and its attention one (kernels/cuda_attention.py).
"""

from __future__ import annotations

import functools

import torch

PDL = True
"""Launch the kernels with programmatic dependent launch where the GPU has it (`launch`)."""
CONFIGS: dict[tuple[int, int], tuple[int, int, int]] = {
    (3072, 2048): (8, 1024, 4), (2048, 2048): (2, 1024, 4), (16384, 2048): (8, 512, 4), (2048, 8192): (8, 1024, 8),
    (128256, 2048): (8, 512, 4)}
"""(N, K) -> (BLOCK_N, BLOCK_K, num_warps) measured fastest: Llama-3.2-1B's five shapes, bench/gpu_gemv.py's grid on an
H200 with programmatic dependent launch (2026-11-27 07:12); other shapes take `config`'s rule."""


def config(n: int, k: int) -> tuple[int, int, int]:
    """The launch shape for an (n, k) weight: rows per program, columns per load, warps (CONFIGS, else a rule
    that gives the same shapes' neighbours: two rows a program for the smallest, eight otherwise)."""
    if (n, k) in CONFIGS:
        return CONFIGS[(n, k)]
    block_n = 2 if n * k <= 2048 * 2048 else 8
    return block_n, min(1024, triton_next_power_of_2(k)), 8 if k >= 8192 else 4


def triton_next_power_of_2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernel():
    """The Triton kernel, defined on first use (triton is imported only where a GPU rank runs it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, res_ptr, N, K, stride_w, eps,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr,
                    RESIDUAL: tl.constexpr, PDL: tl.constexpr):
        dtype = y_ptr.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        cols = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        tiles = w_ptr + rows[:, None] * stride_w + cols[None, :]  # (BLOCK_N, BLOCK_K) pointers of the first tile
        w = tl.load(tiles, mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0)
        if PDL:  # the weights are never written by a kernel before this one; what it wrote is read after the wait
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        scale = 1.0
        if NORM:
            squares = tl.zeros((BLOCK_K,), tl.float32)
            for k0 in tl.range(0, K, BLOCK_K):
                xv = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                squares += xv * xv
            scale = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + eps)
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # (rows, columns) partial products, summed at the end
        for k0 in tl.range(0, K, BLOCK_K):
            c = k0 + cols
            ok = c < K
            if SILU:
                gate = tl.load(x_ptr + c, mask=ok, other=0.0).to(tl.float32)
                up = tl.load(x_ptr + K + c, mask=ok, other=0.0).to(tl.float32)
                act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu, rounded to the dtype
                xv = (act * up).to(dtype).to(tl.float32)
            else:
                xv = tl.load(x_ptr + c, mask=ok, other=0.0).to(tl.float32)
                if NORM:
                    nw = tl.load(nw_ptr + c, mask=ok, other=0.0).to(tl.float32)
                    xv = ((xv * scale).to(dtype).to(tl.float32) * nw).to(dtype).to(tl.float32)
            following = w  # this tile; the next is loaded before its products are summed
            nxt = c + BLOCK_K
            w = tl.load(tiles + k0 + BLOCK_K, mask=(rows[:, None] < N) & (nxt[None, :] < K), other=0.0)
            acc += following.to(tl.float32) * xv[None, :]
        y = tl.sum(acc, 1)  # (BLOCK_N,)
        if RESIDUAL:
            r = tl.load(res_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
            y = y.to(dtype).to(tl.float32) + r
        tl.store(y_ptr + rows, y.to(dtype), mask=rows < N)

    return gemv_kernel


def launch(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
           eps: float, silu: bool, out: torch.Tensor | None = None, shape: tuple[int, int, int] | None = None,
           pdl: bool | None = None) -> torch.Tensor:
    """y (N,) = weight (N, K) @ f(x), f as the module docstring says; x is (K,) or, with `silu`, (2K,). With
    `pdl` (default: PDL on a Hopper or later GPU) the kernel launches while the one before it finishes, loads its
    first weight tile, then waits for that kernel's writes (programmatic dependent launch)."""
    n, k = weight.shape
    want = 2 * k if silu else k
    if x.dim() != 1 or x.shape[0] != want:
        raise ValueError(f"gemv: input of shape {tuple(x.shape)} for a {n} x {k} weight; pass one row of {want}")
    if weight.stride(1) != 1:
        raise ValueError("gemv: the weight's rows must be contiguous; pass weight.contiguous()")
    block_n, block_k, warps = shape or config(n, k)
    y = torch.empty(n, dtype=x.dtype, device=x.device) if out is None else out
    grid = (-(-n // block_n),)
    pdl = PDL and x.is_cuda and dependent_launch(x.device) if pdl is None else pdl
    extra = {"launch_pdl": True} if pdl else {}
    _kernel()[grid](x, weight, y, x if norm_weight is None else norm_weight, x if residual is None else residual,
                    n, k, weight.stride(0), eps, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
                    SILU=silu, RESIDUAL=residual is not None, PDL=pdl, num_warps=warps, **extra)
    return y


@functools.cache
def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may launch before the one ahead of them ends (Hopper and later)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


@torch.library.custom_op("shardlm::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
         eps: float, silu: bool) -> torch.Tensor:
    """weight (N, K) @ f(x) (+ residual): one decode row's product, one launch (see the module docstring)."""
    return launch(x, weight, norm_weight, residual, eps, silu)


@gemv.register_fake
def _gemv_fake(x, weight, norm_weight, residual, eps, silu):
    return x.new_empty(weight.shape[0])


def reference(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
              eps: float, silu: bool) -> torch.Tensor:
    """What `gemv` computes, in torch ops with the module path's roundings and a float64 product."""
    dtype = x.dtype
    if silu:
        gate, up = x.chunk(2)
        x = torch.nn.functional.silu(gate) * up
    if norm_weight is not None:
        x = norm_weight * torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(dtype)
    y = (weight.double() @ x.double()).to(dtype)
    return y if residual is None else residual + y
