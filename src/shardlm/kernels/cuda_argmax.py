"""Greedy decode's argmax over the vocabulary on a GPU in two Triton kernels, as torch.argmax picks (first maximum).

Inductor's argmax over Llama-3.2-1B's 128256 logits took 31 us of a 903 us compiled decode step on an H200
(bench/RESULTS.md, 2026-11-27 07:12): one row's reduction gave it little parallelism. Here each program of a
(rows, chunks) grid finds its chunk's first maximum and a second kernel picks, per row, the first chunk holding the
row's maximum. NaN counts as larger than any number, as in torch.argmax, so the first NaN wins.

A model gets it as `greedy_pick` (runtime/cuda_graph.py `decode_step` uses it for the token a replay feeds the next
one) where runtime/gpu_blocks.py installs the GEMV blocks. On an H200 it took a compiled GEMV step with the split
attention from 1182.0 to 1224.5 tok/s (bench/RESULTS.md 2026-11-27 16:40).
"""

from __future__ import annotations

import torch

CHUNK = 2048
"""Logits a program of the first kernel reads."""


def _kernels():
    """The two Triton kernels (kernels/triton_decode.py, imported on first use)."""
    from shardlm.kernels.triton_decode import chunk_kernel, pick_kernel

    return chunk_kernel, pick_kernel


def launch(logits: torch.Tensor, pdl: bool) -> torch.Tensor:
    """torch.argmax(logits, -1, keepdim=True) for logits (b, V): (b, 1) int64."""
    chunk_kernel, pick_kernel = _kernels()
    b, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("argmax: each row's logits must be contiguous; pass logits.contiguous()")
    chunks = -(-vocab // CHUNK)
    values = torch.empty(b * chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(b * chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(b, 1, dtype=torch.int64, device=logits.device)
    extra = {"launch_pdl": True} if pdl else {}
    chunk_kernel[(b, chunks)](logits, values, indices, vocab, logits.stride(0), CHUNK=CHUNK, PDL=pdl, num_warps=4,
                              **extra)
    pick_kernel[(b,)](values, indices, out, CHUNKS=chunks, CP=max(2, 1 << (chunks - 1).bit_length()), PDL=pdl,
                      num_warps=2, **extra)
    return out


@torch.library.custom_op("shardlm::greedy_argmax", mutates_args=())
def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1, keepdim=True) of logits (b, V) in two launches (see the module docstring)."""
    from shardlm.kernels.cuda_gemv import PDL, dependent_launch

    return launch(logits, PDL and logits.is_cuda and dependent_launch(logits.device))


@greedy_argmax.register_fake
def _greedy_argmax_fake(logits):
    """The output's shape and dtype, for tracing."""
    return logits.new_empty(logits.shape[0], 1, dtype=torch.int64)


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """The greedy tokens (b, 1) of a step's last-position logits (b, 1, V), for `decode_step`."""
    return torch.ops.shardlm.greedy_argmax(logits[:, -1].contiguous())
