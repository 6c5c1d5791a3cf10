"""Weights that do not fit a rank's budget, streamed in ahead of use.

- `store.py`: the disk tier's scratch file (CPU ranks).
- `streamer.py`: hooks that bring streamed layers in from it, with prefetch; LM-head rows in place.
- `device.py`: the GPU tier (pinned host blocks copied in on a side stream).
- `slots.py`: where a streamed layer's weights live while it is away.

Which layers stream is decided by the driver (`plan.streaming`) and arrives in the rank's RankSpec.
"""

from shardlm.runtime.offload.slots import LayerExtent, Slot, hold_apart, layer_tensors
from shardlm.runtime.offload.store import OffloadError, OffloadStore, sweep_stale, trim_heap
from shardlm.runtime.offload.streamer import LayerStreamer, MappedHead, StreamStats

__all__ = ["LayerExtent", "LayerStreamer", "MappedHead", "OffloadError", "OffloadStore", "Slot", "StreamStats",
           "hold_apart", "layer_tensors", "sweep_stale", "trim_heap"]
