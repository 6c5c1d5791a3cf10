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

import ctypes
import errno
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
ALIGN = 4096
VOCAB_CHUNK = 4 * 2**20
"""Bytes of LM-head rows mapped at a time when the head is used in place from the file."""
"""Each layer's extent starts on this boundary (page size; what O_DIRECT reads would need)."""


def vocab_chunk(head_bytes: int) -> int:
    """Bytes of LM-head rows mapped at a time: VOCAB_CHUNK, or an eighth of a smaller head."""
    return min(VOCAB_CHUNK, max(1, head_bytes // 8))


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


def _wrap(owner: object, value: torch.Tensor):
    """What `owner.attr` holds: a frozen Parameter on a module, the tensor itself on a quantized weight."""
    return nn.Parameter(value, requires_grad=False) if isinstance(owner, nn.Module) else value


def _put(owner: object, attr: str, value) -> None:
    """Store an already wrapped `value` (see `_wrap`) as `owner.attr`."""
    if isinstance(owner, nn.Module):
        owner._parameters[attr] = value
    else:
        setattr(owner, attr, value)


def _set(owner: object, attr: str, value: torch.Tensor) -> None:
    _put(owner, attr, _wrap(owner, value))


def _detach(slots: list[Slot]) -> None:
    for s in slots:
        _set(s.owner, s.attr, torch.empty(s.shape, dtype=s.dtype, device="meta"))


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc `malloc_trim`).

    Tensors under the mmap threshold (1 MiB, see worker._steady_malloc) live on the heap: a
    quantized layer's q/k/v/o and MLP codes do, for this model. A layer dropped after it is written
    out frees them, but long-lived objects allocated in between can pin the holes, and in one run
    of five here the rank then kept 1.7 MiB per streamed layer (+45 MiB over 30 layers). Trimming
    after each drop returns those pages, whatever the layout of the heap.
    """
    try:
        _LIBC.malloc_trim(0)
    except AttributeError:  # not glibc
        pass


def sweep_stale(folder: Path) -> list[Path]:
    """Remove scratch files left in `folder` by ranks that no longer run (a SIGKILL skips cleanup);
    returns what was removed."""
    removed = []
    for p in folder.glob(".shardlm-offload-rank*-*.bin"):
        try:
            pid = int(p.stem.rsplit("-", 1)[1])
        except ValueError:
            continue
        if not _alive(pid):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


class OffloadStore:
    """The scratch file of one rank's streamed layers."""

    def __init__(self, folder: Path, rank: int):
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            sweep_stale(self.folder)
            self.path = self.folder / f".shardlm-offload-rank{rank}-{os.getpid()}.bin"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise OffloadError(f"--offload-dir {self.folder} cannot be used ({e.strerror}); give a writable folder "
                               "on a local disk with room for the streamed layers") from e
        self.size = 0
        self.map: mmap.mmap | None = None
        self.flat: torch.Tensor | None = None

    def mapped(self) -> torch.Tensor:
        """The whole file as a uint8 tensor over a private read mapping (made on first use, after the
        last layer was added); its pages are the page cache's, so viewing them copies nothing."""
        if self.flat is None:
            import warnings

            self.map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # frombuffer over a mapping: never written to
                self.flat = torch.frombuffer(self.map, dtype=torch.uint8)
            ptr = ctypes.c_char.from_buffer(self.map)
            self.base = ctypes.addressof(ptr)  # valid while mapped; the export is dropped at once
            del ptr
        return self.flat

    def cached_fraction(self, extent: "LayerExtent", samples: int = 8) -> float:
        """Fraction of `samples` pages spread over a layer's range that are in the page cache (mincore).

        One single-page mincore call per sample: asking for the whole range walked 3,600 pages per
        layer and cost 6 ms per token on the bundled model (measured), a quarter of a decode step."""
        pages = -(-extent.nbytes // ALIGN)
        step = max(1, pages // samples)
        vec = (ctypes.c_ubyte * 1)()
        hits = total = 0
        for page in range(0, pages, step):
            total += 1
            if _LIBC.mincore(ctypes.c_void_p(self.base + extent.offset + page * ALIGN), ctypes.c_size_t(1), vec) == 0:
                hits += vec[0] & 1
        return hits / total

    def madvise(self, offset: int, nbytes: int, advice: int) -> None:
        """madvise(2) on bytes [offset, offset + nbytes) of the mapping, with the GIL released.

        Through ctypes rather than `mmap.madvise`, which holds the GIL: a prefetch thread populating
        a layer from disk (~5 ms) then stalled the compute thread's Python for as long."""
        start = offset - offset % ALIGN
        if _LIBC.madvise(ctypes.c_void_p(self.base + start), ctypes.c_size_t(offset + nbytes - start), advice) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def release(self, extent: "LayerExtent", uncache: bool = False) -> None:
        """Drop a layer's pages from this process's resident set; they stay in the page cache unless
        `uncache`, which evicts them from it too (the next use then reads the disk)."""
        self.release_range(extent.offset, extent.nbytes, uncache)

    def add_tensor(self, parts) -> tuple[int, int]:
        """Write one tensor, given as consecutive row blocks (an iterable of tensors), at a page
        boundary: an embedding or LM head that will be used in place, memory-mapped. Only one block
        is in memory at a time. Returns (offset, bytes)."""
        offset = pos = -(-self.size // ALIGN) * ALIGN
        try:
            for t in parts:
                data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
                self._write_all(memoryview(data), pos)
                pos += data.nbytes
        except OSError as e:
            self.close()
            raise OffloadError(f"writing to --offload-dir {self.folder} failed ({e.strerror}); free space there or "
                               "choose another folder (the partial file was removed)") from e
        self.size = pos
        return offset, pos - offset

    def release_range(self, offset: int, nbytes: int, uncache: bool = False) -> None:
        """Drop the pages of [offset, offset + nbytes) from this process's resident set (and from the
        page cache with `uncache`)."""
        if nbytes <= 0:
            return
        if self.map is not None:
            self.madvise(offset, nbytes, mmap.MADV_DONTNEED)
        if uncache:
            start = offset - offset % ALIGN
            os.posix_fadvise(self.fd, start, offset + nbytes - start, os.POSIX_FADV_DONTNEED)

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
        trim_heap()
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
        self.flat = None
        if self.map is not None:
            self.map.close()
            self.map = None
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
    cached: int = 0
    """Layers found in the page cache when brought in (mmap mode): no disk read was needed."""

    def as_dict(self) -> dict:
        """JSON-ready totals."""
        needed = self.hits + self.waits
        return {"bytes_read": self.bytes_read, "reads": self.reads, "prefetch_hits": self.hits,
                "prefetch_waits": self.waits, "hit_rate": self.hits / needed if needed else None,
                "wait_s": self.wait_s, "page_cache_hits": self.cached}


MADV_POPULATE_READ = 22
"""Linux 5.14+: fault a range of a mapping in (page tables filled, data read if not cached)."""


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
    - "read": `os.preadv` into one of two preallocated buffers (what a GPU path needs: pinned
      host buffers, then a copy on a side stream).
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
        embed_slot = self.vocab_slots.get("model.embed_tokens.weight")
        if self.embed is not None and embed_slot:
            # a lookup maps only the rows it reads; drop them again after
            self.handles.append(self.embed.register_forward_hook(
                lambda m, a, o: self.store.release_range(*embed_slot, self.uncached)))
        head_slot = self.vocab_slots.get("lm_head.weight") or (embed_slot if self.head is not None
                                                               and self.embed is not None
                                                               and self.head.weight is self.embed.weight else None)
        if self.head is not None and head_slot:
            self.head_slot = head_slot
            self.head.row_stream = self._head_in_chunks

    def _head_in_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) @ W^T over the mapped LM head, VOCAB_CHUNK bytes of rows at a time, each chunk
        dropped from the resident set once used -> (..., rows)."""
        from shardlm.kernels import matmul_t

        w = self.head.weight  # (rows, dim), a view of the mapping
        offset, nbytes = self.head_slot
        rows = w.shape[0]
        row_bytes = nbytes // rows
        step = max(1, vocab_chunk(nbytes) // row_bytes)
        outs = []
        for a in range(0, rows, step):
            b = min(rows, a + step)
            outs.append(matmul_t(x, w[a:b]))  # (..., b - a)
            self.store.release_range(offset + a * row_bytes, (b - a) * row_bytes, self.uncached)
        self.stats.bytes_read += nbytes
        return torch.cat(outs, dim=-1)  # (..., rows)

    @property
    def bytes_per_pass(self) -> int:
        """Bytes brought in per forward pass (every streamed layer once, and a mapped LM head)."""
        head = self.head_slot[1] if getattr(self, "head_slot", None) else 0
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
        base = self.store.flat[ext.offset:ext.offset + ext.nbytes] if self.mode == "mmap" else buf
        for s in ext.slots:
            _set(s.owner, s.attr, base[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape))
        self.active[module] = buf
        if self.prefetch:
            self._start(self.next_of[module])

    def _after(self, module: nn.Module, args, output) -> None:
        ext = self.extents[module]
        _detach(ext.slots)
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
        if self.head is not None:
            self.head.__dict__.pop("row_stream", None)
        self.store.close()


def param_bytes(module_name: str, p: torch.Tensor, quantization: str | None, elem: int) -> int:
    """Bytes parameter `p` of module `module_name` will hold once loaded with `elem`-byte floats,
    a quantizable linear weight quantized as asked (with the kernels' padding)."""
    from shardlm.quant_spec import INT4_GROUP, INT8_ALIGN, is_quantizable

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
    """Embedding, final norm and LM head on this rank held in memory (norms and a head block when
    `vocab` says they are used in place from the file)."""
    layer_bytes: dict[int, int]
    streamed: tuple[int, ...]
    buffers: int
    """Read buffers (2 with prefetch, 1 without), each the size of the largest streamed layer."""
    vocab: tuple[str, ...] = ()
    """Embedding / float LM head parameters used in place from the memory-mapped file, a chunk at a
    time, when even streaming every layer would not fit the budget."""


def plan_streaming(model: nn.Module, budget: int | None, quantization: str | None, prefetch: bool,
                   dtype: torch.dtype, stream_last: int | None = None, vocab_ok: bool = True) -> StreamPlan:
    """Keep the first layers resident while embedding/head + resident layers + read buffers fit `budget`;
    stream the rest. Raises OffloadError when even streaming every layer does not fit.

    `stream_last` (a manifest's `offload.layers` for this stage) instead streams exactly the last
    that many layers of the stage, whatever the budget. `vocab_ok` False (GPU ranks) never plans
    the embedding / head in place from a file."""
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
    vocab = {n: p.numel() * elem for n, p in model.named_parameters()
             if n == "model.embed_tokens.weight" or (n == "lm_head.weight" and n not in skip
                                                     and (model.args.tie_embeddings or not quantization))}
    if stream_last is not None:
        if not 0 <= stream_last <= len(order):
            raise OffloadError(f"offload.layers asks to stream {stream_last} layers but this stage has {len(order)}; "
                               f"give 0 to {len(order)}")
        streamed = tuple(order[len(order) - stream_last:])
        return StreamPlan(budget or 0, outer, sizes, streamed, buffers if streamed else 0)
    if outer + sum(sizes.values()) <= budget:
        return StreamPlan(budget, outer, sizes, (), 0)
    biggest = max(sizes.values())
    minimum = outer + buffers * biggest
    mapped: tuple[str, ...] = ()
    if budget < minimum and vocab and vocab_ok:  # use the embedding / head in place from the file too
        chunk = vocab_chunk(max(vocab.values()))  # head rows mapped at a time
        minimum = outer - sum(vocab.values()) + buffers * biggest + chunk
        outer, mapped = outer - sum(vocab.values()) + chunk, tuple(vocab)
    if budget < minimum:
        raise OffloadError(
            f"--memory-budget {budget / 2**20:.1f}MB is below the {minimum / 2**20:.1f} MiB this rank needs at least: "
            f"{outer / 2**20:.1f} MiB {'norms + a vocabulary chunk' if mapped else 'embedding/norm/head'} kept in "
            f"memory + {buffers} read buffer(s) of the largest "
            f"layer ({biggest / 2**20:.1f} MiB); use --memory-budget {-(-minimum // 2**20)}MB or more, add ranks "
            "(--tp/--pp), or quantize (--quantization int8|int4)")
    room = budget - minimum
    resident: list[int] = []
    for i in order:
        if sizes[i] > room:
            break
        resident.append(i)
        room -= sizes[i]
    return StreamPlan(budget, outer, sizes, tuple(i for i in order if i not in resident), buffers, mapped)
