"""The GPU offload tier: layers beyond a GPU rank's budget live in pinned host memory and are
copied in ahead of use on a side CUDA stream, into one of two device buffers.

How one streamed layer L moves (prefetch on):
    before(L):  the compute stream waits (on the GPU, not the host) for L's copy event; L's
                kernel weights become views of its device buffer; the copy of the next streamed layer
                is queued on the copy stream, behind an event saying the compute stream is done
                with the buffer it will overwrite
    after(L):   the views are dropped and an event marks "compute finished with L's buffer"
So the copy of L+1 runs while L computes, and nothing blocks the host: the host only queues work.
Without prefetch there is one buffer and each copy is queued on the compute stream right before
its layer, so copy and compute take turns (the comparison the benchmark makes).

Host copies are pinned (page-locked), which is what lets a copy run asynchronously at full PCIe
bandwidth; each layer's tensors are packed into one pinned block, so a layer is one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardlm.runtime.offload.slots import Slot, detach, hold_apart, slots_of
from shardlm.runtime.offload.streamer import StreamStats

ALIGN = 256
"""Byte alignment of each tensor inside a layer's block (keeps every dtype view aligned)."""


@dataclass
class HostLayer:
    """One streamed layer: its tensors' slots and the pinned host block holding them."""

    slots: list[Slot]
    host: torch.Tensor
    nbytes: int


class PinnedStore:
    """Moves finished layers off the GPU into pinned host blocks (`add`), the GPU tier's `OffloadStore`."""

    def add(self, layer: nn.Module) -> HostLayer:
        """Copy every linear weight of `layer` (float or quantized, held apart first) into one pinned
        block and leave meta placeholders; returns where each tensor went."""
        hold_apart(layer)
        items, size = slots_of(layer, ALIGN)
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        for t, s in items:
            host[s.offset:s.offset + s.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        slots = [s for _, s in items]
        detach(slots)
        return HostLayer(slots, host, size)

    def close(self) -> None:
        """Nothing to remove: the pinned blocks go with the process."""


@dataclass
class DeviceStreamer:
    """Forward hooks that stream `layers` (pinned host -> GPU) in `order`, double-buffered with prefetch."""

    layers: dict[nn.Module, HostLayer]
    order: list[nn.Module]
    device: torch.device
    prefetch: bool = True
    counts: StreamStats = field(default_factory=StreamStats)

    def __post_init__(self):
        self.checks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        biggest = max(h.nbytes for h in self.layers.values())
        self.buffers = [torch.empty(biggest, dtype=torch.uint8, device=self.device)
                        for _ in range(2 if self.prefetch else 1)]
        self.released: list[torch.cuda.Event | None] = [None] * len(self.buffers)
        self.free = list(range(len(self.buffers)))
        self.ready: dict[nn.Module, tuple[int, torch.cuda.Event]] = {}
        self.active: dict[nn.Module, int] = {}
        self.copy_stream = torch.cuda.Stream(self.device) if self.prefetch else None
        self.next_of = {m: self.order[(i + 1) % len(self.order)] for i, m in enumerate(self.order)}
        self.view_cache: dict[tuple[nn.Module, int], list] = {}
        self.handles = []
        for m in self.order:
            self.handles.append(m.register_forward_pre_hook(self._before))
            self.handles.append(m.register_forward_hook(self._after))

    @property
    def stats(self) -> StreamStats:
        """The totals so far. Hits and waits are read off the GPU's own clock: for each use, the time
        from the compute stream reaching the layer to its copy finishing; a layer whose copy had
        finished by then is a hit, else the compute waited that long (summed in `wait_s`)."""
        if self.checks:
            torch.cuda.synchronize(self.device)
            for reached, done in self.checks:
                stall_ms = reached.elapsed_time(done)  # > 0: the copy finished after compute got there
                if stall_ms > 0:
                    self.counts.waits += 1
                    self.counts.wait_s += stall_ms / 1e3
                else:
                    self.counts.hits += 1
            self.checks = []
        return self.counts

    @property
    def bytes_per_pass(self) -> int:
        """Bytes copied to the GPU per forward pass (every streamed layer once)."""
        return sum(h.nbytes for h in self.layers.values())

    def resident_buffer_bytes(self) -> int:
        """Bytes of the device buffers the streamed layers are copied into."""
        return sum(b.numel() for b in self.buffers)

    def _issue(self, module: nn.Module) -> None:
        """Queue the copy of `module`'s block into a free buffer (on the copy stream with prefetch)."""
        i = self.free.pop()
        layer = self.layers[module]
        compute = torch.cuda.current_stream(self.device)
        stream = self.copy_stream or compute
        if self.copy_stream is not None and self.released[i] is not None:
            stream.wait_event(self.released[i])  # the layer that used buffer i has finished computing
        with torch.cuda.stream(stream):
            self.buffers[i][:layer.nbytes].copy_(layer.host, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
        self.ready[module] = (i, done)
        self.counts.bytes_read += layer.nbytes
        self.counts.reads += 1

    def _before(self, module: nn.Module, args) -> None:
        compute = torch.cuda.current_stream(self.device)
        reached = torch.cuda.Event(enable_timing=True)  # the compute stream got to this layer
        reached.record(compute)
        if module not in self.ready:
            self._issue(module)  # on demand: the compute waits for the whole copy
        i, done = self.ready.pop(module)
        compute.wait_event(done)
        self.checks.append((reached, done))
        for owner, attr, value in self._views(module, i):
            setattr(owner, attr, value)
        self.active[module] = i
        nxt = self.next_of[module]
        if self.prefetch and self.free and nxt not in self.ready and nxt not in self.active:
            self._issue(nxt)

    def _views(self, module: nn.Module, i: int) -> list:
        """(owner, field, view) that point `module`'s weights into buffer i, made once per pair: building
        the views on every use cost more host time than the copy itself."""
        key = (module, i)
        if key not in self.view_cache:
            base = self.buffers[i]
            self.view_cache[key] = [(s.owner, s.attr, base[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape))
                                    for s in self.layers[module].slots]
        return self.view_cache[key]

    def _after(self, module: nn.Module, args, output) -> None:
        detach(self.layers[module].slots)
        i = self.active.pop(module)
        released = torch.cuda.Event()
        released.record(torch.cuda.current_stream(self.device))
        self.released[i] = released
        self.free.append(i)
        if len(self.checks) > 8192:
            self.stats  # resolve the GPU-clock checks now and then, so the list stays short
        nxt = self.next_of[module]
        if self.prefetch and nxt not in self.ready and nxt not in self.active:
            self._issue(nxt)

    def close(self) -> None:
        """Remove the hooks and wait for queued copies."""
        for h in self.handles:
            h.remove()
        torch.cuda.synchronize(self.device)
