"""The scratch file of one CPU rank's streamed layers (the disk tier).

At load, the layers that do not fit the rank's budget are written, one at a time as they are read
(and quantized), to a scratch file in the offload folder and dropped from memory. Each layer is one
contiguous extent starting on a 4 KiB boundary, its tensors ordered by element size so every one
is aligned inside it, so bringing a layer back is a single positioned read into a preallocated
buffer, or a range of the file's memory mapping (streamer.py).

The scratch file is private to the run (named by rank and pid) and removed when the rank stops;
it is not a checkpoint format (per-rank checkpoints are `shardlm shard`'s job). A rank killed by
SIGKILL cannot remove it: the next store opened in the folder sweeps files of ranks that are gone.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import torch
from torch import nn

from shardlm.runtime.offload.slots import LayerExtent, detach, hold_apart, slots_of

_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
ALIGN = 4096
"""Each layer's extent starts on this boundary (page size; what O_DIRECT reads would need)."""


class OffloadError(ValueError):
    """An offload folder that cannot be used, or a budget too small to run with."""


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc `malloc_trim`).

    Tensors under the mmap threshold (1 MiB on a rank that streams, see worker.set_malloc) live on the heap: a
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

    def add(self, layer: nn.Module) -> LayerExtent:
        """Write a loaded layer's linear weights to the file and drop them from memory (meta placeholders);
        the layer's float weights are first held apart (see slots.hold_apart)."""
        hold_apart(layer)
        items, size = slots_of(layer, 1)  # ordered by element size: every view is aligned
        offset = self.size = -(-self.size // ALIGN) * ALIGN
        pos = 0
        try:
            for t, slot in items:
                data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
                self._write_all(memoryview(data), offset + slot.offset)
                pos = slot.offset + data.nbytes
        except OSError as e:
            written = self.size + pos
            self.close()
            if e.errno == errno.ENOSPC:
                raise OffloadError(f"--offload-dir {self.folder} filled up after {written / 2**20:.1f} MiB of streamed "
                                   "layers; free space there, choose another folder, or raise --memory-budget "
                                   "(the partial file was removed)") from e
            raise OffloadError(f"writing to --offload-dir {self.folder} failed ({e.strerror}); the partial file "
                               "was removed") from e
        self.size = offset + size
        slots = [s for _, s in items]
        detach(slots)
        items = t = None  # the last references to the written tensors: free them before trimming
        trim_heap()
        return LayerExtent(slots, offset, size)

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


