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
    return block_n, min(1024, next_power_of_2(k)), 8 if k >= 8192 else 4


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, (n - 1).bit_length())


def _kernel():
    """The Triton kernel (kernels/triton_decode.py, imported on first use: only a GPU rank needs triton)."""
    from shardlm.kernels.triton_decode import gemv_kernel

    return gemv_kernel


def launch(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
           eps: float, silu: bool, out: torch.Tensor | None = None, shape: tuple[int, int, int] | None = None,
           pdl: bool | None = None) -> torch.Tensor:
    """y (N,) = weight (N, K) @ f(x), f as the module docstring says; x is (K,) or, with `silu`, (2K,). With
    `pdl` (default: PDL on a Hopper or later GPU) the kernel launches while the one before it finishes, loads its
    first weight tile, then waits for that kernel's writes (programmatic dependent launch)."""
    n, k = weight.shape
    check_inputs(x, weight, norm_weight, residual, silu, out)
    block_n, block_k, warps = shape or config(n, k)
    y = torch.empty(n, dtype=x.dtype, device=x.device) if out is None else out
    grid = (-(-n // block_n),)
    pdl = PDL and x.is_cuda and dependent_launch(x.device) if pdl is None else pdl
    extra = {"launch_pdl": True} if pdl else {}
    _kernel()[grid](x, weight, y, x if norm_weight is None else norm_weight, x if residual is None else residual,
                    n, k, weight.stride(0), eps, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_weight is not None,
                    SILU=silu, RESIDUAL=residual is not None, PDL=pdl, num_warps=warps, **extra)
    return y


def check_inputs(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
                 residual: torch.Tensor | None, silu: bool, out: torch.Tensor | None) -> None:
    """ValueError naming the input the kernel would misread: it takes contiguous vectors of the weight's sizes."""
    n, k = weight.shape
    want = 2 * k if silu else k
    if x.dim() != 1 or x.shape[0] != want or x.stride(0) != 1:
        raise ValueError(f"gemv: input of shape {tuple(x.shape)} (strides {x.stride()}) for a {n} x {k} weight; pass "
                         f"one contiguous row of {want}")
    if weight.stride(1) != 1:
        raise ValueError("gemv: the weight's rows must be contiguous; pass weight.contiguous()")
    if silu and norm_weight is not None:
        raise ValueError("gemv: the gating and the norm do not combine (a decode block never needs both); pass one")
    for name, t, size in (("norm_weight", norm_weight, k), ("residual", residual, n), ("out", out, n)):
        if t is not None and (t.shape != (size,) or t.stride(0) != 1 or t.device != x.device
                              or (name != "norm_weight" and t.dtype != x.dtype)):
            raise ValueError(f"gemv: {name} of shape {tuple(t.shape)}, {t.dtype} on {t.device}; pass a contiguous "
                             f"({size},) tensor on {x.device}" + ("" if name == "norm_weight" else f" in {x.dtype}"))


@functools.cache
def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may launch before the one ahead of them ends: an NVIDIA GPU of compute capability
    9.0 or later (Hopper) and a Triton with grid dependency control."""
    if torch.version.hip is not None or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


@torch.library.custom_op("shardlm::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
         eps: float, silu: bool) -> torch.Tensor:
    """weight (N, K) @ f(x) (+ residual): one decode row's product, one launch (see the module docstring)."""
    return launch(x, weight, norm_weight, residual, eps, silu)


@gemv.register_fake
def _gemv_fake(x, weight, norm_weight, residual, eps, silu):
    """The output's shape and dtype, for tracing."""
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
