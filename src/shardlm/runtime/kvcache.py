"""Pre-allocated key/value cache, one (b, kv_heads, max_len, head_dim) pair per layer."""

from __future__ import annotations

from contextlib import contextmanager

import torch


class KVCache:
    """Keys and values of past tokens for every layer this rank runs.

    Slots are shared by the whole batch: prompts are left-padded to one length, so slot `p` of
    every sequence is written in the same step. `offset` is the number of slots already filled;
    the step advances it once after all layers have run (`advance`).
    """

    def __init__(self, layer_ids: list[int], batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.max_len = max_len
        self.offset = 0
        self._rows = torch.arange(batch)
        self._positions = torch.zeros(batch, dtype=torch.long)
        self.slot: torch.Tensor | None = None
        """While set (see `static`), writes go to this slot and reads return every slot."""

    @contextmanager
    def static(self, slot: torch.Tensor):
        """Shape-static updates for a CUDA graph: one token's k, v go to the slot held in the device
        tensor `slot` (1,), and `update` returns all max_len slots (the mask hides the unfilled ones)."""
        self.slot = slot
        try:
            yield self
        finally:
            self.slot = None

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (b, h, s, hd) at slots [offset, offset+s); return all filled slots (b, h, t, hd)."""
        if self.slot is not None:  # a graph-captured decode step: s == 1, the slot is on the device
            self.k[layer_id].index_copy_(2, self.slot, k)
            self.v[layer_id].index_copy_(2, self.slot, v)
            return self.k[layer_id], self.v[layer_id]  # (b, h, max_len, hd)
        s = k.shape[2]
        end = self.check_room(s)
        self.k[layer_id][:, :, self.offset:end] = k
        self.v[layer_id][:, :, self.offset:end] = v
        return self.k[layer_id][:, :, :end], self.v[layer_id][:, :, :end]

    def fused_target(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, cache row of each batch row, position its new token goes to) for the fused decode
        kernel: row j is cache row j, and every row writes at `offset`."""
        if int(self._positions[0]) != self.offset:
            self._positions.fill_(self.offset)
        return self.k[layer_id], self.v[layer_id], self._rows, self._positions

    def check_room(self, s: int) -> int:
        """The end slot after writing s more tokens; ValueError when the cache cannot hold them."""
        end = self.offset + s
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; this step needs {end}. Raise max_len.")
        return end

    def advance(self, s: int) -> None:
        """Mark s more slots as filled (called once per forward, after the last layer)."""
        self.offset += s

    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())
