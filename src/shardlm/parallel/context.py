"""ParallelContext: a rank's tensor-parallel group and its counted collectives.

Every collective the model issues goes through here, so bytes and seconds per op are recorded
for the monitor. Ranks on one host can use the shared-memory transport (`shm.ShmCollectives`);
otherwise the torch.distributed group (gloo on CPU, NCCL on CUDA) does the work. Ranks that run
on CUDA but talk over gloo (ranks sharing a GPU, which NCCL refuses) stage each tensor through
host memory: copy out, reduce on the host (shared memory when there is one), copy back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class OpStats:
    """Running totals for one collective kind."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class PipePeers:
    """A rank's pipeline neighbours: global ranks with the same tensor-parallel rank on other stages."""

    stage: int
    n_stages: int
    prev: int | None
    """Rank on the previous stage (None on the first)."""
    next: int | None
    """Rank on the next stage (None on the last)."""
    first: int
    """Rank on the first stage (where the last stage sends sampled tokens)."""
    last: int
    """Rank on the last stage."""

    @property
    def is_first(self) -> bool:
        """True on the stage that holds the embedding."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """True on the stage that holds the LM head."""
        return self.stage == self.n_stages - 1


@dataclass
class ParallelContext:
    """One rank's view of its tensor-parallel group and pipeline neighbours.

    `rank`/`world` are the rank's position in and the size of its tensor-parallel group; world size
    1 makes every collective a no-op. `pipe` is None without pipeline parallelism.
    """

    rank: int = 0
    world: int = 1
    group: Any = None
    """torch.distributed process group of the TP ranks (None: the default group)."""
    shm: Any = None
    """Optional shared-memory transport with `all_reduce_` and `all_gather` for same-host ranks."""
    pipe: PipePeers | None = None
    cuda_collectives: bool = False
    """True when the backend moves CUDA tensors itself (NCCL); False: collectives take host tensors."""
    host_group: Any = None
    """Under NCCL with pipeline stages: a gloo group for small host messages (`send(..., host=True)`)."""
    stats: dict[str, OpStats] = field(default_factory=dict)
    _pending: list = field(default_factory=list)

    def _count(self, op: str, nbytes: int, t0: float) -> None:
        s = self.stats.setdefault(op, OpStats())
        s.calls += 1
        s.bytes += nbytes
        s.seconds += time.perf_counter() - t0

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Reduce `t` over the group in place (sum, or `op` such as dist.ReduceOp.MAX) and return it
        (bitwise identical on every rank)."""
        if self.world == 1:
            return t
        t0 = time.perf_counter()
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if t.is_cuda and not self.cuda_collectives:
            host = t.cpu()  # staged: this backend takes host tensors
            self._reduce(host, nbytes, op)
            t.copy_(host)
        else:
            self._reduce(t, nbytes, op)
        self._count("all_reduce", nbytes, t0)
        return t

    def _reduce(self, t: torch.Tensor, nbytes: int, op: Any) -> None:
        if op is None and self.shm is not None and not t.is_cuda and nbytes <= self.shm.max_bytes:
            self.shm.all_reduce_(t)
        else:
            dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=self.group)

    def all_gather(self, t: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim`; rank r contributes `sizes[r]` entries there."""
        if self.world == 1:
            return t
        t0 = time.perf_counter()
        device = t.device
        t = t.contiguous() if self.cuda_collectives or not t.is_cuda else t.cpu()  # staged like all_reduce
        part_bytes = t.numel() // max(t.shape[dim], 1) * max(sizes) * t.element_size()  # same on every rank
        if self.shm is not None and not t.is_cuda and part_bytes <= self.shm.max_bytes:
            out = self.shm.all_gather(t, dim)
        else:
            out = _padded_all_gather(t, dim, sizes, self.group)
        self._count("all_gather", out.numel() * out.element_size(), t0)
        return out.to(device)

    def _wire(self, host: bool = False) -> torch.device:
        """Where point-to-point tensors must live for this backend (`host`: for the host-message group)."""
        if self.cuda_collectives and not (host and self.host_group is not None):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def send(self, t: torch.Tensor, dst: int, host: bool = False) -> None:
        """Start sending `t` to global rank `dst` and return at once (the tensor is kept until sent).

        Sends between one pair of ranks (and of one kind, `host` or not) arrive in the order they
        were made. `host`: a small host-side message (a header, sampled tokens), which goes over the
        gloo host group when the world runs on NCCL. `flush` waits for all.
        """
        t0 = time.perf_counter()
        t = t.to(self._wire(host)).contiguous()
        group = self.host_group if host and self.cuda_collectives else None
        self._pending = [(w, x) for w, x in self._pending if not w.is_completed()]
        self._pending.append((dist.isend(t, dst, group=group), t))
        self._count("send", t.numel() * t.element_size(), t0)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, host: bool = False) -> torch.Tensor:
        """Receive a tensor of `shape` and `dtype` from global rank `src` (blocks; the group's timeout
        applies). It arrives on the backend's device: the GPU under NCCL, else host memory; `host`
        as in `send`."""
        t0 = time.perf_counter()
        t = torch.empty(shape, dtype=dtype, device=self._wire(host))
        dist.recv(t, src, group=self.host_group if host and self.cuda_collectives else None)
        self._count("recv", t.numel() * t.element_size(), t0)
        return t

    def flush(self) -> None:
        """Wait until every send this rank started has been delivered."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Plain-dict copy of the counters."""
        return {op: {"calls": s.calls, "bytes": s.bytes, "seconds": s.seconds} for op, s in self.stats.items()}


def _padded_all_gather(t: torch.Tensor, dim: int, sizes: list[int], group: Any) -> torch.Tensor:
    """all_gather for uneven sizes: pad each part to the largest along `dim`, gather, trim, join."""
    dim = dim % t.dim()
    biggest = max(sizes)
    if t.shape[dim] < biggest:
        pad_shape = list(t.shape)
        pad_shape[dim] = biggest - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad_shape)], dim=dim)
    parts = [torch.empty_like(t) for _ in sizes]
    dist.all_gather(parts, t, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)
