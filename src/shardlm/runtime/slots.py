"""The KV cache of a serving rank: one slot per request, allocated once, each at its own length.

Layout per layer: keys and values of shape (slots, kv_heads, max_len, head_dim), sized from the
Plan's `kv_cache` (max_batch slots of max_seq_len tokens). A request keeps its slot from admission
to its last token and its tokens sit at positions 0, 1, 2 ... of it (no left padding), so a row's
attention never depends on which other requests share the step.

A `SlotRun` is the cache as one forward pass sees it (the model's Cache protocol):
- a prefill chunk: one slot, tokens at [start, start + s); keys come back as a view of the slot;
- prefill chunks of several slots in one pass, right-padded to one width s: row j writes [start_j,
  start_j + s) of its own slot. The padding lands past the row's last real token, where the row's next
  token overwrites it before any query can see it (a query at p attends to keys <= p only);
- a decode step: several slots, one new token each at its own position; the fused CPU kernel reads
  and writes the slots in place (`fused_target`), the module path gathers the rows it attends over.
"""

from __future__ import annotations

import torch


class SlotCache:
    """Keys and values of `slots` requests of up to `max_len` tokens, for every layer this rank runs."""

    def __init__(self, layer_ids: list[int], slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.slots, self.max_len, self.device = slots, max_len, torch.device(device)

    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())

    def copy(self, src: int, dst: int, start: int, end: int) -> None:
        """Keys and values at positions [start, end) of slot `src` into slot `dst`, in every layer this rank runs
        (a prompt prefix another request computed: the same bits the `dst` request's own prefill would write)."""
        if not (0 <= src < self.slots and 0 <= dst < self.slots and src != dst and 0 <= start <= end <= self.max_len):
            raise ValueError(f"KV cache copy of positions [{start}, {end}) from slot {src} to slot {dst}: the cache "
                             f"has {self.slots} slots of {self.max_len} tokens (the driver sent a bad step)")
        for layers in (self.k, self.v):
            for t in layers.values():
                t[dst, :, start:end].copy_(t[src, :, start:end])

    def prefill(self, slot: int, start: int, length: int) -> "SlotRun":
        """The cache for a chunk of `length` tokens of `slot` at positions [start, start + length)."""
        return SlotRun(self, [slot], [start], length)

    def prefill_rows(self, slots: list[int], starts: list[int], width: int) -> "SlotRun":
        """The cache for chunks of several slots right-padded to `width` tokens: row j at [starts[j], +width)."""
        return SlotRun(self, slots, starts, width)

    def decode(self, slots: list[int], positions: list[int]) -> "SlotRun":
        """The cache for one new token in each of `slots`, at `positions`."""
        return SlotRun(self, slots, positions, 1)


class SlotRun:
    """One forward pass's view of a SlotCache (see the module docstring)."""

    def __init__(self, cache: SlotCache, slots: list[int], starts: list[int], length: int):
        end = max(starts) + length
        if end > cache.max_len:
            raise ValueError(f"KV cache slots hold {cache.max_len} tokens; this step needs {end}. Raise "
                             "kv_cache.max_seq_len")
        self.cache, self.length = cache, length
        self.rows = torch.tensor(slots, dtype=torch.long, device=cache.device)  # (b,)
        self.positions = torch.tensor(starts, dtype=torch.long, device=cache.device)  # (b,) first new position
        self.slot0, self.start0, self.single = slots[0], starts[0], len(slots) == 1
        self.offset = end - 1  # the fused kernel's key count is offset + 1
        self.k, self.v = cache.k, cache.v

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this pass's keys and values (b, h, s, hd) in their slots; return the keys and values the
        rows attend over (b, h, t, hd): the slot itself for one row, a gathered copy for several."""
        kc, vc = self.cache.k[layer_id], self.cache.v[layer_id]
        if self.single:
            a, b = self.start0, self.start0 + k.shape[2]
            kc[self.slot0, :, a:b] = k[0]
            vc[self.slot0, :, a:b] = v[0]
            return kc[self.slot0:self.slot0 + 1, :, :b], vc[self.slot0:self.slot0 + 1, :, :b]
        if k.shape[2] == 1:
            kc[self.rows, :, self.positions] = k[:, :, 0]  # (b, h, hd) at each row's own position
            vc[self.rows, :, self.positions] = v[:, :, 0]
        else:
            at = self.positions[:, None] + torch.arange(k.shape[2], device=k.device)  # (b, s) each row's positions
            kc[self.rows[:, None], :, at] = k.transpose(1, 2)  # (b, s, h, hd)
            vc[self.rows[:, None], :, at] = v.transpose(1, 2)
        t = self.offset + 1
        return kc[self.rows, :, :t], vc[self.rows, :, :t]  # (b, h, t, hd)

    def fused_target(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, slot of each row, position of each row's new token) for the fused decode kernel."""
        return self.cache.k[layer_id], self.cache.v[layer_id], self.rows, self.positions

    def check_room(self, s: int) -> None:
        """Checked when the run was made (every row's end is within the slots)."""
