"""How tensor-parallel ranks divide heads, the MLP width and the vocabulary: any degree, nearly even.

These rules are the single source of truth for who owns what; the loader, the sharder and the
planner all call them.
"""

from __future__ import annotations

from dataclasses import dataclass


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous chunks of `n` items that differ by at most one (larger first)."""
    if parts < 1 or parts > n:
        raise ValueError(f"cannot split {n} items into {parts} non-empty parts; use 1 to {n} parts")
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk `index` when `n` items are split by `split_sizes`."""
    sizes = split_sizes(n, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


BLOCK = 32
"""Columns the quantized kernels take together (csrc/qrows.h quantizes inputs in blocks of 32; int4 groups are 32
wide): the MLP width is split in whole blocks, so that every rank's slice of a row-parallel weight starts on a block
boundary and its partial sums add up to what one rank computes (see shardlm.quant)."""


def block_range(n: int, parts: int, index: int, block: int = BLOCK) -> tuple[int, int]:
    """[start, stop) of chunk `index` of `n` items split into `parts` runs of whole `block`s, nearly even (larger
    first); the last chunk also takes the `n % block` remainder. With fewer blocks than parts, `split_range`."""
    blocks = n // block
    if blocks < parts:
        return split_range(n, parts, index)
    a, b = split_range(blocks, parts, index)
    return a * block, n if index == parts - 1 else b * block


@dataclass(frozen=True)
class HeadSplit:
    """Query heads split into `tp` contiguous chunks; each rank holds the KV heads its chunk reads.

    With group size g = n_heads / n_kv_heads, query head h reads KV head h // g. A rank holding
    query heads [a, b) therefore needs KV heads [a // g, (b - 1) // g + 1). A KV head whose group
    straddles two ranks is held by both (replicated), and when tp > n_kv_heads every rank still
    holds at least one KV head.
    """

    n_heads: int
    n_kv_heads: int
    tp: int

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} query heads are not a multiple of {self.n_kv_heads} KV heads")
        if not 1 <= self.tp <= self.n_heads:
            raise ValueError(
                f"tensor-parallel degree {self.tp} is outside 1..{self.n_heads}: every rank needs at "
                f"least one of the model's {self.n_heads} attention heads; use --tp {self.n_heads} or fewer"
            )

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def q_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the query heads `rank` owns."""
        return split_range(self.n_heads, self.tp, rank)

    def kv_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the KV heads `rank` holds (some possibly replicated on a neighbour)."""
        a, b = self.q_range(rank)
        return a // self.group, (b - 1) // self.group + 1

    def kv_map(self, rank: int) -> list[int]:
        """For each local query head, the index of the local KV head it reads."""
        a, b = self.q_range(rank)
        kv0 = self.kv_range(rank)[0]
        return [h // self.group - kv0 for h in range(a, b)]

    def kv_replicas(self) -> int:
        """KV heads held in total across ranks minus the model's KV heads (the replication cost)."""
        held = sum(b - a for a, b in (self.kv_range(r) for r in range(self.tp)))
        return held - self.n_kv_heads
