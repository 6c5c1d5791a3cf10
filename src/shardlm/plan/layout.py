"""ParallelLayout: data x pipeline x tensor degrees, stage layer ranges and the devices of every rank.

Ranks are numbered replica-major, then stage, then tensor rank:
    rank = (replica * pp + stage) * tp + tp_rank
so the tp ranks of one stage are consecutive (one node, fast links) and a stage's successor is
`tp` ranks further on.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout whose degrees, layer ranges or device lists contradict each other; names the fix."""


@dataclass(frozen=True)
class RankCoord:
    """Where one rank sits in the layout."""

    rank: int
    replica: int
    stage: int
    tp_rank: int
    device: str
    """Device address "node:index"."""


@dataclass(frozen=True)
class ParallelLayout:
    """How a model is split: validated on construction, immutable afterwards."""

    tp: int
    """Tensor-parallel degree (ranks per stage)."""
    pp: int
    """Pipeline stages."""
    dp: int
    """Data-parallel replicas (each a full copy of the pipeline)."""
    stage_layers: tuple[tuple[int, int], ...]
    """[start, stop) decoder layers of each stage; contiguous, covering every layer once."""
    devices: tuple[tuple[tuple[str, ...], ...], ...]
    """devices[replica][stage][tp_rank] = "node:index"."""

    def __post_init__(self):
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallelism.{name} must be at least 1, got {getattr(self, name)}")
        if len(self.stage_layers) != self.pp:
            raise LayoutError(f"{len(self.stage_layers)} stage layer ranges for pipeline degree {self.pp}; "
                              "give one range per stage")
        check_ranges(self.stage_layers)
        if len(self.devices) != self.dp or any(len(r) != self.pp for r in self.devices) or \
                any(len(s) != self.tp for r in self.devices for s in r):
            raise LayoutError(f"devices must list {self.dp} replica(s) x {self.pp} stage(s) x {self.tp} device(s)")
        flat = [d for r in self.devices for s in r for d in s]
        dup = sorted({d for d in flat if flat.count(d) > 1})
        if dup:
            raise LayoutError(f"device(s) {', '.join(dup)} are assigned to more than one rank; give each rank its own")

    @property
    def world(self) -> int:
        """Total ranks."""
        return self.dp * self.pp * self.tp

    @property
    def n_layers(self) -> int:
        """Decoder layers covered."""
        return self.stage_layers[-1][1]

    def coord(self, rank: int) -> RankCoord:
        """Coordinates of `rank`."""
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} is outside 0..{self.world - 1}")
        replica, rest = divmod(rank, self.pp * self.tp)
        stage, tp_rank = divmod(rest, self.tp)
        return RankCoord(rank, replica, stage, tp_rank, self.devices[replica][stage][tp_rank])

    def coords(self) -> list[RankCoord]:
        """Every rank's coordinates, in rank order."""
        return [self.coord(r) for r in range(self.world)]

    def rank_of(self, replica: int, stage: int, tp_rank: int) -> int:
        """The global rank at (replica, stage, tp_rank): the inverse of `coord`."""
        if not (0 <= replica < self.dp and 0 <= stage < self.pp and 0 <= tp_rank < self.tp):
            raise LayoutError(f"(replica {replica}, stage {stage}, tp rank {tp_rank}) is outside a layout of "
                              f"dp {self.dp} x pp {self.pp} x tp {self.tp}")
        return (replica * self.pp + stage) * self.tp + tp_rank

    def tp_groups(self) -> list[tuple[int, ...]]:
        """The ranks of every tensor-parallel group (one per replica and stage), in a fixed order that every
        rank can create process groups in."""
        return [tuple(self.rank_of(r, s, t) for t in range(self.tp)) for r in range(self.dp) for s in range(self.pp)]

    def stage_of_layer(self, layer: int) -> int:
        """The stage that runs decoder layer `layer`."""
        for s, (a, b) in enumerate(self.stage_layers):
            if a <= layer < b:
                return s
        raise LayoutError(f"layer {layer} is in no stage")


def check_ranges(ranges: tuple[tuple[int, int], ...] | list, n_layers: int | None = None) -> None:
    """Raise LayoutError unless the ranges are non-empty, contiguous from 0 and (if given) end at n_layers."""
    expect = 0
    for i, (a, b) in enumerate(ranges):
        if a != expect:
            kind = "overlaps the previous stage" if a < expect else "leaves a gap after the previous stage"
            raise LayoutError(f"stage {i} starts at layer {a} but the previous stage ends at {expect}: it {kind}; "
                              f"start stage {i} at layer {expect}")
        if b <= a:
            raise LayoutError(f"stage {i} has the empty layer range [{a}, {b}); every stage needs at least one layer")
        expect = b
    if n_layers is not None and expect != n_layers:
        raise LayoutError(f"the stages cover layers 0..{expect - 1} but the model has {n_layers} layers; "
                          f"end the last stage at {n_layers}")
