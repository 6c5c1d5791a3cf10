"""Streamed layers brought in from the scratch file ahead of use, with a double-buffered prefetcher.

Forward hooks on the streamed layers do the work: before layer i runs, its read (started earlier by
the prefetcher thread) is awaited and its kernel weights attached; the read of the next streamed
layer starts at once, so the disk works while layer i computes; after layer i, its weights are
detached and its buffer goes back to the pool. `os.preadv` and our madvise release the GIL, so the
read really overlaps the matmuls. With prefetch off each layer is read when needed.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from shardlm.kernels.linear import matmul_t
from shardlm.plan.streaming import vocab_chunk
from shardlm.runtime.offload.slots import LayerExtent, attach, detach
from shardlm.runtime.offload.store import OffloadStore

MADV_POPULATE_READ = 22
"""Linux 5.14+: fault a range of a mapping in (page tables filled, data read if not cached)."""


@dataclass
class StreamStats:
    """What streaming cost so far."""

    bytes_read: int = 0
    reads: int = 0
    hits: int = 0
    """Layers whose read had finished when the layer was needed."""
    waits: int = 0
    """Layers the compute had to wait for (a prefetch still running, or no prefetch)."""
    wait_s: float = 0.0
    cached: int = 0
    """Layers found in the page cache when brought in (mmap mode): no disk read was needed."""

    def as_dict(self) -> dict:
        """JSON-ready totals."""
        needed = self.hits + self.waits
        return {"bytes_read": self.bytes_read, "reads": self.reads, "prefetch_hits": self.hits,
                "prefetch_waits": self.waits, "hit_rate": self.hits / needed if needed else None,
                "wait_s": self.wait_s, "page_cache_hits": self.cached}


@dataclass
class MappedHead:
    """An LM head whose rows are used in place from the memory-mapped scratch file: the kernel weight of
    the head module. Each product maps a block of rows at a time and drops it from the resident set
    once used, so the head never occupies more than one block of memory."""

    weight: torch.Tensor
    """(rows, dim), a view of the mapping."""
    store: OffloadStore
    offset: int
    size: int
    """Bytes of the rows in the file."""
    stats: StreamStats
    uncached: bool = False
    gemv: object = None
    """The compiled kernels, or None."""

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) @ W^T -> (..., rows), VOCAB_CHUNK bytes of rows at a time."""
        rows = self.weight.shape[0]
        row_bytes = self.size // rows
        step = max(1, vocab_chunk(self.size) // row_bytes)
        outs = []
        for a in range(0, rows, step):
            b = min(rows, a + step)
            outs.append(matmul_t(x, self.weight[a:b], self.gemv))  # (..., b - a)
            self.store.release_range(self.offset + a * row_bytes, (b - a) * row_bytes, self.uncached)
        self.stats.bytes_read += self.size
        return torch.cat(outs, dim=-1)  # (..., rows)

    def nbytes(self) -> int:
        """Bytes held: the rows are the page cache's, mapped a block at a time."""
        return 0


@dataclass
class LayerStreamer:
    """Forward hooks that bring streamed layers in ahead of use and evict them after.

    Two ways to bring a layer in (`mode`):
    - "mmap" (default): the layer's tensors are views of the memory-mapped scratch file. Bringing it
      in = populating the page tables of its range (MADV_POPULATE_READ: the kernel reads from disk
      what the page cache lacks; nothing is copied); evicting = MADV_DONTNEED, which drops the
      pages from this process but not from the page cache. With a warm cache this costs almost
      nothing, where a copy costs a core: on 2 cores, copying 14 MB layers while both cores compute
      made decode slower with prefetch than without (17.4 vs 21.0 tok/s, bench/offload.py).
    - "read": `os.preadv` into one of two preallocated buffers.
    At most two layers are in memory at a time with prefetch (the running one and the next), one without.
    """

    store: OffloadStore
    extents: dict[nn.Module, LayerExtent]
    order: list[nn.Module]
    """Streamed layers in the order the forward pass runs them."""
    prefetch: bool = True
    mode: str = "mmap"
    uncached: bool = False
    """Evict each layer from the page cache too after use, so every use reads the disk (benchmarks:
    the worst case, a model much larger than RAM)."""
    vocab_slots: dict = field(default_factory=dict)
    """{parameter name: (offset, bytes)} of an embedding / LM head used in place from the mapping."""
    embed: nn.Module | None = None
    head: nn.Module | None = None
    stats: StreamStats = field(default_factory=StreamStats)

    def __post_init__(self):
        if self.uncached:  # the load wrote the file through the page cache: start cold
            os.fsync(self.store.fd)
            os.posix_fadvise(self.store.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        slots = 2 if self.prefetch else 1
        if self.mode == "mmap" or self.vocab_slots:
            self.store.mapped()
        if self.mode == "mmap":
            self.free: list = [None] * slots  # tokens: how many layers may be mapped at once
        else:
            biggest = max((e.nbytes for e in self.extents.values()), default=0)
            self.free = [torch.empty(biggest, dtype=torch.uint8) for _ in range(slots)]
        self.populate = True
        self.pending: dict[nn.Module, tuple[Future, object]] = {}
        self.active: dict[nn.Module, object] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardlm-prefetch") if self.prefetch else None
        self.next_of = {m: self.order[(i + 1) % len(self.order)] for i, m in enumerate(self.order)}
        self.handles = []
        for m in self.order:
            self.handles.append(m.register_forward_pre_hook(self._before))
            self.handles.append(m.register_forward_hook(self._after))
        self.head_slot = self._install_vocab()

    def _install_vocab(self) -> tuple[int, int] | None:
        """Hooks for an embedding used in place (drop the rows a lookup mapped) and a MappedHead as the
        head's kernel weight; returns the head's (offset, bytes) when it is mapped."""
        embed_slot = self.vocab_slots.get("model.embed_tokens.weight")
        if self.embed is not None and embed_slot:
            self.handles.append(self.embed.register_forward_hook(
                lambda m, a, o: self.store.release_range(*embed_slot, self.uncached)))
        tied = self.head is not None and self.embed is not None and self.head.weight is not None \
            and self.head.weight is getattr(self.embed, "weight", None)  # not an int8 table (no float weight)
        head_slot = self.vocab_slots.get("lm_head.weight") or (embed_slot if tied else None)
        if self.head is not None and head_slot:
            self.head.kernel_weight = MappedHead(self.head.weight, self.store, *head_slot, self.stats, self.uncached)
        return head_slot

    @property
    def bytes_per_pass(self) -> int:
        """Bytes brought in per forward pass (every streamed layer once, and a mapped LM head)."""
        head = self.head_slot[1] if self.head_slot else 0
        return sum(e.nbytes for e in self.extents.values()) + head

    def resident_buffer_bytes(self) -> int:
        """Bytes of anonymous read buffers ("read" mode; mapped pages are the page cache's)."""
        held = list(self.free) + list(self.active.values()) + [b for _, b in self.pending.values()]
        return sum(b.numel() for b in held if isinstance(b, torch.Tensor))

    def _bring(self, module: nn.Module, buf) -> None:
        ext = self.extents[module]
        if self.mode == "mmap":
            self._populate(ext)
        else:
            self.store.read(ext, buf)
        self.stats.bytes_read += ext.nbytes
        self.stats.reads += 1

    def _populate(self, ext: LayerExtent) -> None:
        # In the page cache already: leave it to the compute's page faults, which map cached pages
        # 16 at a time (fault-around). Measured on the bundled model at a 128 MiB budget, tok/s with
        # no hint 31, MADV_WILLNEED 28, MADV_POPULATE_READ 24 (it takes the pages one by one).
        # Not cached: populate, i.e. read it now (in the prefetch thread when there is one).
        if self.store.cached_fraction(ext) > 0.9:
            self.stats.cached += 1
            return
        if self.populate:
            try:
                self.store.madvise(ext.offset, ext.nbytes, MADV_POPULATE_READ)
                return
            except OSError:  # kernel older than 5.14: touch one byte per page instead
                self.populate = False
        flat = self.store.flat
        int(flat[ext.offset:ext.offset + ext.nbytes:4096].sum())

    def _start(self, module: nn.Module) -> None:
        if module in self.pending or module in self.active or not self.free:
            return
        buf = self.free.pop()
        self.pending[module] = (self.pool.submit(self._bring, module, buf), buf)

    def _before(self, module: nn.Module, args) -> None:
        if module in self.pending:
            fut, buf = self.pending.pop(module)
            if fut.done():
                self.stats.hits += 1
            else:
                self.stats.waits += 1
                t0 = time.perf_counter()
                fut.result()
                self.stats.wait_s += time.perf_counter() - t0
            fut.result()  # re-raise a read error
        else:
            self.stats.waits += 1
            t0 = time.perf_counter()
            buf = self.free.pop()
            self._bring(module, buf)
            self.stats.wait_s += time.perf_counter() - t0
        ext = self.extents[module]
        attach(ext.slots, self.store.flat[ext.offset:ext.offset + ext.nbytes] if self.mode == "mmap" else buf)
        self.active[module] = buf
        if self.prefetch:
            self._start(self.next_of[module])

    def _after(self, module: nn.Module, args, output) -> None:
        ext = self.extents[module]
        detach(ext.slots)
        if self.mode == "mmap" or self.uncached:
            self.store.release(ext, self.uncached)
        self.free.append(self.active.pop(module))
        if self.prefetch:
            self._start(self.next_of[module])

    def close(self) -> None:
        """Stop the prefetcher, remove the hooks and the scratch file."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for h in self.handles:
            h.remove()
        if self.head is not None and isinstance(self.head.kernel_weight, MappedHead):
            self.head.kernel_weight = None
        self.store.close()
