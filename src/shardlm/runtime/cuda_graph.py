"""Decode steps on a GPU as CUDA graph replays.

Eager decode on a GPU is bound by the host, not the GPU: a step of a 16-layer model issues a few
hundred small kernels, and on the H100 machine we measured (bench/RESULTS.md) an eager step of
Llama-3.2-1B took 12.4 ms, against a memory floor of 0.83 ms. A CUDA graph records one
step's kernels once and replays them with one launch.

A graph replays the same kernels on the same buffers, so the step is made shape-static:
- inputs live in fixed device buffers (tokens (b, 1), positions (b, 1), mask (b, 1, 1, L) over
  all L slots of the KV cache), refilled before each replay;
- the cache writes the new key/value at a slot held in a device tensor (`KVCache.static`), and
  attention reads every slot, the mask hiding the unfilled ones (they get exactly zero weight).
So one graph serves every step of a generate call, and later calls of the same batch size and
cache length (rounded up to BUCKET slots) reuse it with its cache; each model keeps the last KEEP
such shapes. The logits come out in a fixed buffer.

Used for one-GPU ranks (no collectives between processes, whose host-side bookkeeping a replay
would skip) without streamed layers (their hooks move weights between steps): the rank builder
decides that once (`build.choose_kernels`; SHARDLM_CUDA_GRAPHS=0 turns it off) and gives the
RankModel a `GraphDecoders`. A capture that fails falls back to eager decode.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.runtime.kvcache import KVCache

log = logging.getLogger(__name__)


KEEP = 4
"""Captured graphs (with their KV caches) kept per model, most recently used first."""
BUCKET = 256
"""Cache lengths are rounded up to a multiple of this, so requests of similar length share a graph."""


class GraphDecoders:
    """The captured decode steps of one rank's model, by cache shape, most recently used last."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.kept: OrderedDict[tuple, GraphDecoder] = OrderedDict()

    def decoder(self, layer_ids: list[int], batch: int, kv_heads: int, length: int, head_dim: int,
                dtype: torch.dtype, device: torch.device) -> "GraphDecoder | None":
        """The GraphDecoder for this cache shape: the one captured earlier for the same batch and bucketed
        length, with its cache, or a new one with a new cache; None when capturing it failed before."""
        length = -(-length // BUCKET) * BUCKET
        key = (batch, kv_heads, length, head_dim, dtype, tuple(layer_ids))
        dec = self.kept.pop(key, None)
        if dec is None:
            while len(self.kept) >= KEEP:  # free the least recently used before allocating another cache
                self.kept.popitem(last=False)
            dec = GraphDecoder(self.model, KVCache(layer_ids, batch, kv_heads, length, head_dim, dtype, device))
        self.kept[key] = dec
        return None if dec.failed else dec


class GraphDecoder:
    """Replays one captured decode step; owns the KV cache the step was captured on."""

    def __init__(self, model: nn.Module, cache: KVCache):
        self.model, self.cache, self.rows = model, cache, None
        first = next(iter(cache.k.values()))  # (b, kv heads, length, head dim)
        b, length, dev = first.shape[0], cache.max_len, first.device
        self.tokens = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.mask = torch.zeros(b, 1, 1, length, dtype=torch.bool, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.device = dev
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.failed = False

    def bind(self, rows) -> None:
        """Serve the generate call of `rows` (built on this decoder's cache), from an empty cache."""
        self.rows = rows
        self.cache.offset = 0

    def _forward(self) -> torch.Tensor:
        with self.cache.static(self.slot):
            return self.model(self.tokens, self.positions, self.mask, self.cache, last_only=True)

    def _capture(self) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up off the capture: lazy inits, cuBLAS workspaces
            for _ in range(2):
                self._forward()  # writes this step's key/value at its slot: the replay writes the same
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._forward()
        self.graph = graph

    def step(self, token: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Feed `token` (b,) at the next slot: (logits (b, 1, vocab) float32, the step's host mask).
        The logits are None when capturing failed; the caller then runs this step eagerly with the mask."""
        rows, cache = self.rows, self.cache
        cache.check_room(1)
        mask = rows.next_token()  # (b, 1, 1, t) on the host; advances positions and valid
        t = mask.shape[-1]
        self.mask.copy_(F.pad(mask, (0, cache.max_len - t)), non_blocking=True)  # (b, 1, 1, L)
        self.tokens.copy_(token[:, None], non_blocking=True)
        self.positions.copy_(rows.positions, non_blocking=True)
        self.slot.fill_(cache.offset)
        if self.graph is None:
            try:
                self._capture()
            except Exception as e:  # noqa: BLE001 - eager decode still works; say why once
                log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
                self.failed = True
                return None, mask
        self.graph.replay()
        cache.advance(1)
        return self.logits, mask
