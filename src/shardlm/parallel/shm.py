"""Shared-memory all-reduce and all-gather for ranks on one host (the CPU fast path beside gloo).

Segment layout (one POSIX shared-memory segment per group):

    header: world x 64 bytes, one cache line per rank (no false sharing) holding 8 int64:
            [0] seq: the last step this rank published
            [1 + 2*parity] numel, [2 + 2*parity] size along the gather dim, for each step parity
    data:   world x 2 slots of max_bytes (rounded up to 64), slot (rank, step % 2)

Memory ordering: this targets x86-64 (TSO), where stores become visible in program order and loads are
not reordered with other loads or with later stores. A rank therefore writes its data and its header
fields first and its seq counter last (torch's copy_ returns only after its worker threads joined),
and a reader that sees seq == step also sees that step's data.
The 8-byte counters are aligned, so their loads and stores never tear. Other architectures would need
explicit fences here.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import time
import weakref
from multiprocessing import shared_memory

import torch

_LINE = 64  # bytes per header line and slot alignment
_FIELDS = _LINE // 8  # int64 fields per header line
_SPIN = 16  # busy polls (~0.1 us each) before sched_yield; more only costs when ranks share a core
_REDUCIBLE = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _attach(name: str, size: int, timeout_s: float) -> mmap.mmap:
    """Map rank 0's segment (Linux: /dev/shm/<name>), waiting for it to appear and be sized.

    Not through SharedMemory: on Python < 3.13 that registers the name with resource_tracker, and
    spawned ranks share their parent's tracker, which keeps a *set* of names, so an attacher's
    register + unregister would drop the creator's entry (the tracker then prints a KeyError when the
    creator unlinks, and no longer cleans up after a crashed creator).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                found = os.fstat(fd).st_size
                if found == size:
                    return mmap.mmap(fd, size)
                if found:  # 0 while rank 0 is between creating and sizing it
                    raise ValueError(f"segment {name!r} has {found} bytes, expected {size}: "
                                     "every rank must pass the same world and max_bytes")
            finally:
                os.close(fd)
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"shared memory segment {name!r} did not appear within {timeout_s:.1f} s")
        time.sleep(0.001)


def _release(views: list, shm: shared_memory.SharedMemory | None, mapping: mmap.mmap | None) -> None:
    """Release the memoryviews, unmap, and (creator) unlink; weakref.finalize runs it at most once."""
    for v in views:
        v.release()
    if mapping is not None:
        mapping.close()
    if shm is not None:
        shm.close()
        with contextlib.suppress(FileNotFoundError):  # from_group unlinks early
            shm.unlink()


class ShmCollectives:
    """Sum all-reduce and all-gather over a shared-memory segment for `world` ranks on one host.

    Calls are collectives: every rank makes the same sequence of calls. Each call is one step: a rank
    copies its tensor into its slot for the step's parity, publishes seq = step, waits until every
    peer's seq >= step, then reads all slots in rank order. Results are bitwise identical on all ranks.

    A TimeoutError (a dead or stuck peer) leaves the group out of step: close it and build a new one.

    Why two slots per rank are enough: a rank writes its parity-p slot for step s + 2 only after it
    finished waiting at step s + 1, which needs every peer to have published s + 1, which each peer
    does only after it finished reading step s's slots. So no slot is overwritten while being read.
    """

    def __init__(self, name: str, rank: int, world: int, max_bytes: int, timeout_s: float = 300.0,
                 *, create: bool):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside world {world}; use 0 <= rank < world")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.name, self.rank, self.world, self.timeout_s = name, rank, world, timeout_s
        self.max_bytes, self._slot_bytes = max_bytes, -(-max_bytes // _LINE) * _LINE  # rounded up to _LINE
        header, size = world * _LINE, world * _LINE + world * 2 * self._slot_bytes
        # The creator's SharedMemory is registered with resource_tracker, which unlinks it if rank 0 dies.
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=size) if create else None
        self._mmap = None if create else _attach(name, size, timeout_s)
        buf = self._shm.buf if create else memoryview(self._mmap)
        self._views = [buf[:header].cast("q")] + ([] if create else [buf])
        self._hdr = self._views[0]  # int64 fields, _FIELDS per rank
        self._data = torch.frombuffer(buf, dtype=torch.uint8, offset=header, count=size - header)
        self._cache: dict = {}
        self._step = 0
        self._seq_fields = [p * _FIELDS for p in range(world) if p != rank]
        self._spin = _SPIN if world <= len(os.sched_getaffinity(0)) else 0  # more ranks than cores: yield
        self._finalizer = weakref.finalize(self, _release, self._views, self._shm, self._mmap)

    @classmethod
    def from_group(cls, group, max_bytes: int, timeout_s: float = 300.0, prefix: str = "shardlm"):
        """Build on every rank of a gloo `group`: rank 0 creates, a barrier, the others attach.

        Rank 0 picks a fresh name and broadcasts it. After a second barrier rank 0 unlinks the name,
        so the segment lives only as long as the mappings: even a killed run leaves nothing in /dev/shm.
        """
        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        names = [f"{prefix}_{os.getpid()}_{os.urandom(4).hex()}" if rank == 0 else None]
        dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
        if rank == 0:
            coll = cls(names[0], rank, world, max_bytes, timeout_s, create=True)
        dist.barrier(group=group)
        if rank != 0:
            coll = cls(names[0], rank, world, max_bytes, timeout_s, create=False)
        dist.barrier(group=group)
        if rank == 0:
            coll._shm.unlink()
        return coll

    def close(self) -> None:
        """Unmap the segment (rank 0 also unlinks it). Idempotent; also runs at exit and on GC."""
        self._cache.clear()
        self._data = torch.empty(0, dtype=torch.uint8)  # drop the tensor over memory about to be unmapped
        self._finalizer()

    def _slot(self, rank: int, parity: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """The (rank, parity) slot as a `shape` tensor of `dtype`, cached (views cost microseconds)."""
        key = (rank, parity, dtype, shape)
        view = self._cache.get(key)
        if view is None:
            if not self._finalizer.alive:
                raise RuntimeError("ShmCollectives used after close()")
            if len(self._cache) > 256:  # many distinct shapes (prefill lengths): start over
                self._cache.clear()
            offset = (rank * 2 + parity) * self._slot_bytes
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            view = self._cache[key] = self._data.narrow(0, offset, nbytes).view(dtype).view(shape)
        return view

    def _publish(self, t: torch.Tensor, dim_size: int) -> int:
        """Copy `t` into this rank's slot, publish the step (counter last), wait; return the parity."""
        if t.device.type != "cpu" or t.numel() * t.element_size() > self.max_bytes:
            raise ValueError(f"ShmCollectives takes CPU tensors of at most max_bytes={self.max_bytes}, got "
                             f"{t.numel() * t.element_size()} bytes on {t.device}; raise max_bytes if needed")
        self._step += 1
        step, parity, base = self._step, self._step & 1, self.rank * _FIELDS
        self._slot(self.rank, parity, t.dtype, t.shape).copy_(t)
        self._hdr[base + 1 + 2 * parity] = t.numel()
        self._hdr[base + 2 + 2 * parity] = dim_size
        self._hdr[base] = step  # last: a peer that sees it reads a complete slot (x86 TSO)
        self._wait(step)
        return parity

    def _wait(self, step: int) -> None:
        hdr, seqs = self._hdr, self._seq_fields
        polls, start = 0, 0.0
        while True:
            for i in seqs:
                if hdr[i] < step:
                    break
            else:
                return
            polls += 1
            if polls <= self._spin:
                continue
            if polls == self._spin + 1:
                start = time.monotonic()
            os.sched_yield()  # let a descheduled peer run (tp 3-4 on 2 cores)
            if polls % 256 == 0 and time.monotonic() - start > self.timeout_s:
                missing = [i // _FIELDS for i in seqs if hdr[i] < step]
                raise TimeoutError(f"rank {self.rank}: peer ranks {missing} did not reach step {step} "
                                   f"of shared-memory group {self.name!r} within {self.timeout_s:.1f} s "
                                   f"(dead or stuck peer?)")

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over all ranks in place and return it (float32/float64/bfloat16/float16, CPU).

        Every rank adds the slots in rank order 0..world-1, in float32 for reduced-precision dtypes,
        so every rank ends with bitwise-identical values.
        """
        if t.dtype not in _REDUCIBLE:
            raise ValueError(f"all_reduce_ supports {_REDUCIBLE}, got {t.dtype}")
        parity, numel = self._publish(t, 0), t.numel()
        counts = [self._hdr[p * _FIELDS + 1 + 2 * parity] for p in range(self.world)]
        if counts.count(numel) != self.world:
            raise RuntimeError(f"ranks all-reduced different sizes {counts}: "
                               "collectives called in a different order on some rank?")
        if self.world == 1:
            return t
        slots = [self._slot(p, parity, t.dtype, t.shape) for p in range(self.world)]
        if t.dtype in (torch.float32, torch.float64):
            torch.add(slots[0], slots[1], out=t)
            for s in slots[2:]:
                t.add_(s)
        else:
            acc = slots[0].float()
            for s in slots[1:]:
                acc.add_(s)
            t.copy_(acc)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim` (rank order); sizes along `dim` may differ.

        Any dtype; the other dims must match on every rank. Returns a new tensor.
        """
        dim = dim % t.dim()
        parity = self._publish(t, t.shape[dim])
        rest, parts = math.prod(t.shape[:dim] + t.shape[dim + 1:]), []
        for p in range(self.world):
            numel, size = self._hdr[p * _FIELDS + 1 + 2 * parity], self._hdr[p * _FIELDS + 2 + 2 * parity]
            if numel != size * rest:
                raise RuntimeError(f"rank {p} gathered {numel} elements, {size} along dim {dim}; that does "
                                   f"not fit rank {self.rank}'s shape {tuple(t.shape)}")
            parts.append(self._slot(p, parity, t.dtype, t.shape[:dim] + (size,) + t.shape[dim + 1:]))
        return torch.cat(parts, dim)
