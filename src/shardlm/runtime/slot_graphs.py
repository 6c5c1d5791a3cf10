"""The serving engine's decode steps on one GPU as CUDA graph replays.

An eager decode step of a GPU rank is bound by the host issuing a few hundred small kernels (bench/RESULTS.md:
125-134 tok/s for Llama-3.2-1B on an H200, against 544 replayed). A graph replays fixed kernels on fixed
buffers, so a step of the engine is made shape-static here:

- rows: the first `rows` slots of the cache, `rows` a power of two (or all slots) covering every slot that
  decodes this step. Row i is slot i, so a row attends over its own slot without gathering it. Slots that do not
  decode this step ride along as idle rows: token 0, position max_len - 1. An idle row's key and value land in
  the last position of its own slot, which no query reads before its own token writes it (a query at p reads
  keys <= p, written in the same pass), so an idle row never changes what a live request sees;
- length: each row attends over the first `length` positions of its slot (max position + 1 rounded up to
  BUCKET), under a mask built inside the graph from the positions (and the sliding window);
- inputs are copied into fixed device buffers before each replay (`stage`, through pinned buffers used in turn:
  a copy from pageable memory may wait for the GPU's work in flight); logits come out in a fixed buffer.

One graph per (rows, length), captured when first needed and kept (at most KEEP, least recently used first out),
all in one memory pool (replays never overlap). A capture that fails leaves the engine decoding eagerly.
Used on one-GPU ranks (no collectives, nothing streamed: runtime/build.py `choose_kernels`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from shardlm.runtime.cuda_graph import BUCKET, warm_up
from shardlm.runtime.slots import SlotCache

log = logging.getLogger(__name__)

KEEP = 32
"""Captured (rows, length) shapes kept per rank."""


def deterministic_attention() -> None:
    """Keep this process's attention off cuDNN's fused SDPA kernel. Measured with bench/gpu_rows.py on an H200
    (2026-11-26): Llama-3.2-1B bfloat16, 8 rows of one prompt replayed teacher-forced for 128 steps: with the kernel
    PyTorch picks (cuDNN's flash forward) the 8-row replay's logits differed run to run, and row from row, from
    position 71 on; with SDPA's math kernel they were the same in every row and every run over all 128 steps.
    On an H100 (2026-11-27) with cuDNN off: rows and runs equal again, but a masked grouped-query call then took
    the math kernel, which repeats K/V, and the engine's decode fell from 510 to 400 tok/s (1 row) and from 3700
    to 2330 (8 rows), and 8 rows no longer matched the lone row. Decode attention now folds a KV head's query heads
    into query positions (models/llama.py grouped_attention), a call the memory-efficient kernel takes (not yet
    measured on a GPU). Called by serving ranks that keep rows request-intrinsic (SHARDLM_BATCH_INVARIANT, on by
    default)."""
    torch.backends.cuda.enable_cudnn_sdp(False)


class GraphRun:
    """The cache as a captured decode step sees it (the model's Cache protocol): rows [0, rows) of the slots,
    one new token each at its position, keys and values over the first `length` positions."""

    def __init__(self, cache: SlotCache, rows: torch.Tensor, positions: torch.Tensor, length: int):
        self.cache, self.rows, self.positions, self.length = cache, rows, positions, length

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (b, h, 1, hd) at each row's position of its slot; return (b, h, length, hd) views."""
        kc, vc = self.cache.k[layer_id], self.cache.v[layer_id]  # (slots, h, max_len, hd)
        b = k.shape[0]
        kc[self.rows, :, self.positions] = k[:, :, 0]  # (b, h, hd) at (row, position) pairs
        vc[self.rows, :, self.positions] = v[:, :, 0]
        return kc[:b, :, :self.length], vc[:b, :, :self.length]


class SlotGraphs:
    """Captured decode steps of one serving rank (see the module docstring)."""

    def __init__(self, model: nn.Module, cache: SlotCache, window: int | None):
        self.model, self.cache, self.window = model, cache, window
        n, dev = cache.slots, cache.device
        self.tokens = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.rows = torch.arange(n, device=dev)
        self.keys = torch.arange(cache.max_len, device=dev)
        self.kept: OrderedDict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = OrderedDict()
        self.pool = None
        self.failed = False
        """A capture failed: the rank decodes eagerly from then on."""
        self.staging = [torch.zeros(4 * n, dtype=torch.long, pin_memory=dev.type == "cuda") for _ in range(2)]
        """Per staged step, in turn, its first 4 x rows values as (4, rows) (see `stage`)."""
        self.inputs = torch.zeros(4 * n, dtype=torch.long, device=dev)
        self.staged = 0

    def shape(self, slots: list[int], positions: list[int]) -> tuple[int, int]:
        """(rows, length) of the graph that serves these decode rows."""
        top = max(slots) + 1
        rows = min(self.cache.slots, 1 << (top - 1).bit_length())
        length = min(self.cache.max_len, -(-(max(positions) + 1) // BUCKET) * BUCKET)
        return rows, length

    def _forward(self, rows: int, length: int) -> torch.Tensor:
        """The captured step: logits (rows, 1, vocab) float32."""
        positions = self.positions[:rows]  # (rows, 1)
        keys = self.keys[:length]
        mask = keys[None, :] <= positions  # (rows, length): a row sees its slot's keys up to its position
        if self.window is not None:
            mask = mask & (keys[None, :] > positions - self.window)
        run = GraphRun(self.cache, self.rows[:rows], positions[:, 0], length)
        return self.model(self.tokens[:rows], positions, mask[:, None, None, :], run, last_only=True)

    def _capture(self, rows: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        warm_up(lambda: self._forward(rows, length), self.cache.device)  # writes what the replay writes
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(rows, length)
        return graph, logits

    def _graph(self, rows: int, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """The graph of this shape (captured now if new) and its logits buffer; None once a capture failed."""
        key = (rows, length)
        got = self.kept.pop(key, None)
        if got is None:
            while len(self.kept) >= KEEP:
                self.kept.popitem(last=False)
            try:
                got = self._capture(rows, length)
            except Exception as e:  # noqa: BLE001 - eager decode still works; say why once
                log.warning("CUDA graph capture of a serving step failed (%s: %s); decoding eagerly",
                            type(e).__name__, e)
                self.failed = True
                return None
        self.kept[key] = got
        return got

    def stage(self, rows: int, slots: list[int], positions: list[int], tokens: list[int | None],
              held: torch.Tensor | None = None) -> torch.Tensor:
        """Write decode rows' inputs (slot, position, token fed) into the graph's buffers for `rows` rows (the shape
        that serves them, `shape`); idle rows get token 0 at their slot's last position. A token None takes
        held[slot] (held: (slots,) on the device, tokens sampled there and not read back; runtime/ahead.py). Returns
        the staged values on the device, (4, rows): tokens, positions, rows fed from `held`, rows that decode. Each
        step's values go through a contiguous block of a pinned buffer, the two used in turn, so a buffer is written
        again only after the step before last, whose copy is done once that step's tokens have been read."""
        fed, at = [0] * rows, [self.cache.max_len - 1] * rows
        from_held, decoding = [0] * rows, [0] * rows
        for slot, position, token in zip(slots, positions, tokens):
            fed[slot], at[slot] = (0 if token is None else token), position
            from_held[slot], decoding[slot] = int(token is None), 1
        stage = self.staging[self.staged % 2][:4 * rows].view(4, rows)
        self.staged += 1
        stage.copy_(torch.tensor([fed, at, from_held, decoding], dtype=torch.long))
        inputs = self.inputs[:4 * rows].view(4, rows)
        inputs.copy_(stage, non_blocking=True)
        self.tokens[:rows, 0] = inputs[0] if held is None else torch.where(inputs[2].bool(), held[:rows], inputs[0])
        self.positions[:rows, 0] = inputs[1]
        return inputs

    def logits(self, slots: list[int], positions: list[int], tokens: list[int]) -> torch.Tensor | None:
        """Logits (b, 1, vocab) float32 of decode rows (slot, position, token fed), in their order; None when
        capturing failed (the caller runs the step eagerly)."""
        if self.failed:
            return None
        rows, length = self.shape(slots, positions)
        self.stage(rows, slots, positions, tokens)
        got = self._graph(rows, length)
        if got is None:
            return None
        graph, logits = got
        graph.replay()
        return logits[torch.tensor(slots, device=logits.device)]  # (b, 1, vocab)
