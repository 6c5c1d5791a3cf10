"""Decoder layers streamed from disk under a memory budget, with a double-buffered prefetcher.

At load, the layers that do not fit the rank's budget are written, one at a time as they are read
(and quantized), to a scratch file in the offload folder and dropped from memory. Each layer is one
contiguous extent starting on a 4 KiB boundary, its tensors ordered by element size so every one
is aligned inside it, so bringing a layer back is a single positioned read into a preallocated
buffer, and its tensors are views of that buffer (no copy, no allocation per step).

At run time forward hooks on the streamed layers do the rest: before layer i runs, its read (started
earlier by the prefetcher thread) is awaited and its tensors attached; the read of the next
streamed layer starts at once into the other buffer, so the disk works while layer i computes;
after layer i, its tensors are detached and its buffer goes back to the pool. `os.preadv` releases
the GIL, so the read really overlaps the matmuls. With prefetch off each layer is read when needed.

The scratch file is private to the run (named by rank and pid) and removed when the rank stops;
it is not a checkpoint format (per-rank checkpoints are `shardlm shard`'s job).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

ALIGN = 4096
"""Each layer's extent starts on this boundary (page size; what O_DIRECT reads would need)."""


class OffloadError(ValueError):
    """An offload folder that cannot be used, or a budget too small to run with."""


@dataclass
class Slot:
    """One tensor of a streamed layer: where it lives in the layer's extent and where it goes."""

    owner: object
    """A module (tensor is one of its parameters) or a quantized weight object (tensor is a field)."""
    attr: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass
class LayerExtent:
    """A streamed layer: its slots and its byte range in the scratch file."""

    slots: list[Slot]
    offset: int
    nbytes: int


def layer_tensors(module: nn.Module) -> list[tuple[object, str, torch.Tensor]]:
    """(owner, attribute, tensor) for every weight of a layer: parameters and quantized fields."""
    out: list[tuple[object, str, torch.Tensor]] = []
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                out.append((sub, name, p))
        quant = sub.__dict__.get("quant")
        if quant is not None:
            for name, value in vars(quant).items():
                if isinstance(value, torch.Tensor):
                    out.append((quant, name, value))
    return out


def _set(owner: object, attr: str, value: torch.Tensor) -> None:
    if isinstance(owner, nn.Module):
        owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        setattr(owner, attr, value)


def _detach(slots: list[Slot]) -> None:
    for s in slots:
        _set(s.owner, s.attr, torch.empty(s.shape, dtype=s.dtype, device="meta"))


class OffloadStore:
    """The scratch file of one rank's streamed layers."""

    def __init__(self, folder: Path, rank: int):
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.path = self.folder / f".shardlm-offload-rank{rank}-{os.getpid()}.bin"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise OffloadError(f"--offload-dir {self.folder} cannot be used ({e.strerror}); give a writable folder "
                               "on a local disk with room for the streamed layers") from e
        self.size = 0

    def add(self, module: nn.Module) -> LayerExtent:
        """Write a loaded layer's tensors to the file and drop them from memory (meta placeholders)."""
        items = sorted(layer_tensors(module), key=lambda it: -it[2].element_size())  # aligned views later
        offset = self.size = -(-self.size // ALIGN) * ALIGN
        slots, pos = [], 0
        try:
            for owner, attr, t in items:
                data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
                self._write_all(memoryview(data), offset + pos)
                slots.append(Slot(owner, attr, tuple(t.shape), t.dtype, pos, data.nbytes))
                pos += data.nbytes
        except OSError as e:
            written = self.size + pos
            self.close()
            if e.errno == errno.ENOSPC:
                raise OffloadError(f"--offload-dir {self.folder} filled up after {written / 2**20:.1f} MiB of streamed "
                                   "layers; free space there, choose another folder, or raise --memory-budget "
                                   "(the partial file was removed)") from e
            raise OffloadError(f"writing to --offload-dir {self.folder} failed ({e.strerror}); the partial file "
                               "was removed") from e
        self.size = offset + pos
        _detach(slots)
        return LayerExtent(slots, offset, pos)

    def _write_all(self, view: memoryview, offset: int) -> None:
        while len(view):
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def read(self, extent: LayerExtent, buf: torch.Tensor) -> None:
        """Read a layer's extent into the front of `buf` (uint8); releases the GIL while reading."""
        view = memoryview(buf.numpy())[:extent.nbytes]
        offset = extent.offset
        while len(view):
            n = os.preadv(self.fd, [view], offset)
            if n == 0:
                raise OffloadError(f"the offload file {self.path} is shorter than expected; was it removed?")
            view, offset = view[n:], offset + n

    def close(self) -> None:
        """Close and remove the scratch file."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            Path(self.path).unlink(missing_ok=True)


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

    def as_dict(self) -> dict:
        """JSON-ready totals."""
        needed = self.hits + self.waits
        return {"bytes_read": self.bytes_read, "reads": self.reads, "prefetch_hits": self.hits,
                "prefetch_waits": self.waits, "hit_rate": self.hits / needed if needed else None,
                "wait_s": self.wait_s}


@dataclass
class LayerStreamer:
    """Forward hooks that bring streamed layers in ahead of use and evict them after."""

    store: OffloadStore
    extents: dict[nn.Module, LayerExtent]
    order: list[nn.Module]
    """Streamed layers in the order the forward pass runs them."""
    prefetch: bool = True
    stats: StreamStats = field(default_factory=StreamStats)

    def __post_init__(self):
        biggest = max(e.nbytes for e in self.extents.values())
        self.free = [torch.empty(biggest, dtype=torch.uint8) for _ in range(2 if self.prefetch else 1)]
        self.pending: dict[nn.Module, tuple[Future, torch.Tensor]] = {}
        self.active: dict[nn.Module, torch.Tensor] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardlm-prefetch") if self.prefetch else None
        self.lock = threading.Lock()
        self.next_of = {m: self.order[(i + 1) % len(self.order)] for i, m in enumerate(self.order)}
        self.handles = []
        for m in self.order:
            self.handles.append(m.register_forward_pre_hook(self._before))
            self.handles.append(m.register_forward_hook(self._after))

    @property
    def bytes_per_pass(self) -> int:
        """Bytes read from disk per forward pass (every streamed layer once)."""
        return sum(e.nbytes for e in self.extents.values())

    def resident_buffer_bytes(self) -> int:
        """Bytes of the read buffers."""
        return sum(b.numel() for b in self.free) + sum(b.numel() for b in self.active.values()) + \
            sum(b.numel() for _, b in self.pending.values())

    def _read(self, module: nn.Module, buf: torch.Tensor) -> None:
        ext = self.extents[module]
        self.store.read(ext, buf)
        self.stats.bytes_read += ext.nbytes
        self.stats.reads += 1

    def _start(self, module: nn.Module) -> None:
        if module in self.pending or module in self.active or not self.free:
            return
        buf = self.free.pop()
        self.pending[module] = (self.pool.submit(self._read, module, buf), buf)

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
            self._read(module, buf)
            self.stats.wait_s += time.perf_counter() - t0
        ext = self.extents[module]
        for s in ext.slots:
            _set(s.owner, s.attr, buf[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape))
        self.active[module] = buf
        if self.prefetch:
            self._start(self.next_of[module])

    def _after(self, module: nn.Module, args, output) -> None:
        _detach(self.extents[module].slots)
        self.free.append(self.active.pop(module))
        if self.prefetch:
            self._start(self.next_of[module])

    def close(self) -> None:
        """Stop the prefetcher, remove the hooks and the scratch file."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        for h in self.handles:
            h.remove()
        self.store.close()


def param_bytes(module_name: str, p: torch.Tensor, quantization: str | None, elem: int) -> int:
    """Bytes parameter `p` of module `module_name` will hold once loaded with `elem`-byte floats,
    a quantizable linear weight quantized as asked (with the kernels' padding)."""
    from shardlm.quant import INT4_GROUP, INT8_ALIGN, is_quantizable

    if quantization not in ("int8", "int4") or p.dim() != 2 or not is_quantizable(module_name):
        return p.numel() * elem
    rows, cols = p.shape
    if quantization == "int8":
        return rows * (cols + -cols % INT8_ALIGN) + rows * 2
    groups = -(-cols // INT4_GROUP) + 1  # a slice not starting on a group boundary pads one more
    return (rows + -rows % 16) * (groups * INT4_GROUP // 2 + groups * 4)


def estimated_bytes(module: nn.Module, quantization: str | None, elem: int, prefix: str = "",
                    skip: frozenset = frozenset()) -> int:
    """Bytes `module` (built on meta) will hold once loaded; parameters named in `skip` (full names
    under `prefix`) are left out."""
    total = 0
    for name, sub in module.named_modules(prefix=prefix.rstrip(".")):
        for pname, p in sub._parameters.items():
            full = f"{name}.{pname}" if name else pname
            if p is not None and full not in skip:
                total += param_bytes(name, p, quantization, elem)
    return total


@dataclass(frozen=True)
class StreamPlan:
    """Which of a rank's layers stream from disk under its budget."""

    budget: int
    outer_bytes: int
    """Embedding, final norm and LM head on this rank (always resident)."""
    layer_bytes: dict[int, int]
    streamed: tuple[int, ...]
    buffers: int
    """Read buffers (2 with prefetch, 1 without), each the size of the largest streamed layer."""

    @property
    def resident_layer_bytes(self) -> int:
        """Bytes of the layers kept in memory."""
        return sum(b for i, b in self.layer_bytes.items() if i not in self.streamed)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the read buffers."""
        return self.buffers * max((self.layer_bytes[i] for i in self.streamed), default=0)


def plan_streaming(model: nn.Module, budget: int, quantization: str | None, prefetch: bool,
                   dtype: torch.dtype) -> StreamPlan:
    """Keep the first layers resident while embedding/head + resident layers + read buffers fit `budget`;
    stream the rest. Raises OffloadError when even streaming every layer does not fit."""
    elem = torch.empty(0, dtype=dtype).element_size()
    layers = {int(k): v for k, v in model.model.layers.items()}
    sizes = {i: estimated_bytes(m, quantization, elem) for i, m in layers.items()}
    # a tied head is the embedding, counted once; an untied head is quantized with the layers
    skip = frozenset(model.tied_weight_names()) | {f"model.layers.{i}.{n}" for i, m in layers.items()
                                                   for n, _ in m.named_parameters()}
    outer = estimated_bytes(model, quantization, elem, skip=skip | {"lm_head.weight"})
    head = model.lm_head
    if head is not None and "lm_head.weight" not in skip:  # a tied head held as a copy stays float
        outer += param_bytes("lm_head", head.weight, None if model.args.tie_embeddings else quantization, elem)
    buffers = 2 if prefetch else 1
    order = sorted(sizes)
    if outer + sum(sizes.values()) <= budget:
        return StreamPlan(budget, outer, sizes, (), 0)
    biggest = max(sizes.values())
    minimum = outer + buffers * biggest
    if budget < minimum:
        raise OffloadError(
            f"--memory-budget {budget / 2**20:.1f}MB is below the {minimum / 2**20:.1f} MiB this rank needs at least: "
            f"{outer / 2**20:.1f} MiB embedding/norm/head kept in memory + {buffers} read buffer(s) of the largest "
            f"layer ({biggest / 2**20:.1f} MiB); use --memory-budget {-(-minimum // 2**20)}MB or more, add ranks "
            "(--tp/--pp), or quantize (--quantization int8|int4)")
    room = budget - minimum
    resident: list[int] = []
    for i in order:
        if sizes[i] > room:
            break
        resident.append(i)
        room -= sizes[i]
    return StreamPlan(budget, outer, sizes, tuple(i for i in order if i not in resident), buffers)
