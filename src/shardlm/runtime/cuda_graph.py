"""Decode steps on a GPU as CUDA graph replays.

Eager decode on a GPU is bound by the host, not the GPU: a step of a 16-layer model issues a few
hundred small kernels, and on the H100 machine we measured (bench/RESULTS.md) an eager step of
Llama-3.2-1B took 12.4 ms, against a memory floor of 0.83 ms. A CUDA graph records one
step's kernels once and replays them with one launch.

A graph replays the same kernels on the same buffers, so the step is made shape-static:
- inputs live in fixed device buffers (tokens (b, 1), positions (b, 1), mask (b, 1, 1, L) over
  all L slots of the KV cache), refilled before each replay;
- the cache writes the new key/value at a slot held in a device tensor (`KVCache.static`), and
  attention reads every slot, the mask hiding the unfilled ones (they get exactly zero weight).
So one graph serves every step of a generate call, and later calls of the same batch size and
cache length (rounded up to BUCKET slots) reuse it with its cache; each model keeps the last KEEP
such shapes. The logits come out in a fixed buffer.

Without a sliding window the replay also advances its own inputs (`decode_step`): it marks the new
slot in the mask, then moves the positions and the slot on by one, so after the first step of a call
the host copies in only the fed token (no mask built and copied per step). With a sliding window the
host builds each step's mask, as keys drop out of it.

Greedy decode runs ahead (`run_ahead`): each replay also writes its argmax where the next one reads its
token, so the GPU never waits for the host between steps; the host reads the tokens back a few steps
behind to stop at EOS.

With `compile` (SHARDLM_CUDA_COMPILE=1) the step is `torch.compile`d before it is captured: Inductor
fuses the norms, rotary and gating into a few kernels, so a replay launches far fewer of them. The
compile happens at the first step of each new shape (about 20 s for a 16-layer model on the H200 machine).

Used for one-GPU ranks (no collectives between processes, whose host-side bookkeeping a replay
would skip) without streamed layers (their hooks move weights between steps): the rank builder
decides that once (`build.choose_kernels`; SHARDLM_CUDA_GRAPHS=0 turns it off) and gives the
RankModel a `GraphDecoders`. A capture that fails falls back to eager decode.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.runtime.kvcache import KVCache

log = logging.getLogger(__name__)


AHEAD = 2
"""Greedy replays queued ahead of the host reading their tokens (see `GraphDecoder.run_ahead`)."""
KEEP = 4
"""Captured graphs (with their KV caches) kept per model, most recently used first."""
BUCKET = 256
"""Cache lengths are rounded up to a multiple of this, so requests of similar length share a graph."""


def decode_step(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                slot: torch.Tensor, cache: KVCache, advance: bool) -> torch.Tensor:
    """One shape-static decode step (the cache in `static` mode at `slot`): logits (b, 1, vocab).
    With `advance`, the step marks `slot` in `mask` (b, 1, 1, L) first, then moves `positions` (b, 1) and
    `slot` (1,) on by one and writes its greedy token into `tokens`, so the next replay needs no input from
    the host (greedy decode), or only its token (sampling)."""
    if advance:
        mask.index_fill_(-1, slot, True)
    logits = model(tokens, positions, mask, cache, last_only=True)
    if advance:
        positions.add_(1)
        slot.add_(1)
        pick = getattr(model, "greedy_pick", None)  # a model's own argmax kernel (kernels/cuda_argmax.py), if set
        chosen = pick(logits) if pick is not None else logits[:, -1].argmax(-1, keepdim=True)
        tokens.copy_(chosen)  # (b, 1): the greedy token, fed by the next replay
    return logits


def allow_recompiles(n: int) -> None:
    """Let dynamo compile decode_step for up to `n` shapes (batch size, cache bucket) before it runs the step
    uncompiled; its default (8) counts across every decoder and model of the process. A process setting."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), n))


def compile_mode(model: nn.Module) -> str | None:
    """Inductor's mode for the decode step: on a GPU its GEMM autotuning and coordinate-descent tuning of the
    fused kernels, without Inductor's own CUDA graphs (the step is captured here). On an H200 a Llama-3.2-1B
    replay took 1.091 ms against 1.166 ms in the default mode, for about the same compile time (bench/RESULTS.md)."""
    first = next(model.parameters(), None)
    return "max-autotune-no-cudagraphs" if first is not None and first.is_cuda else None


def warm_up(fn, device: torch.device, times: int = 2) -> None:
    """Run `fn` `times` on a side stream before it is captured (lazy inits, cuBLAS workspaces, compiling); the
    current stream waits for it, also when it fails, so an eager fallback cannot race its writes."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            for _ in range(times):
                fn()
    finally:
        torch.cuda.current_stream(device).wait_stream(side)


class GraphDecoders:
    """The captured decode steps of one rank's model, by cache shape, most recently used last."""

    def __init__(self, model: nn.Module, compile: bool = False):
        self.model = model
        self.kept: OrderedDict[tuple, GraphDecoder] = OrderedDict()
        if compile:
            allow_recompiles(64)
        self.step_fn = torch.compile(decode_step, dynamic=False, mode=compile_mode(model)) if compile else decode_step
        """What each decoder captures: decode_step, compiled once here (a new shape recompiles it)."""

    def decoder(self, layer_ids: list[int], batch: int, kv_heads: int, length: int, head_dim: int,
                dtype: torch.dtype, device: torch.device) -> "GraphDecoder | None":
        """The GraphDecoder for this cache shape: the one captured earlier for the same batch and bucketed
        length, with its cache, or a new one with a new cache; None when capturing it failed before."""
        length = -(-length // BUCKET) * BUCKET
        key = (batch, kv_heads, length, head_dim, dtype, tuple(layer_ids))
        dec = self.kept.pop(key, None)
        if dec is None:
            while len(self.kept) >= KEEP:  # free the least recently used before allocating another cache
                self.kept.popitem(last=False)
            cache = KVCache(layer_ids, batch, kv_heads, length, head_dim, dtype, device)
            dec = GraphDecoder(self.model, cache, self.step_fn)
        self.kept[key] = dec
        return None if dec.failed else dec


class GraphDecoder:
    """Replays one captured decode step; owns the KV cache the step was captured on."""

    def __init__(self, model: nn.Module, cache: KVCache, step_fn=decode_step):
        self.model, self.cache, self.rows, self.step_fn = model, cache, None, step_fn
        first = next(iter(cache.k.values()))  # (b, kv heads, length, head dim)
        b, length, dev = first.shape[0], cache.max_len, first.device
        self.tokens = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.mask = torch.zeros(b, 1, 1, length, dtype=torch.bool, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.advance = getattr(getattr(model, "args", None), "sliding_window", None) is None
        """The replay advances mask, positions and slot itself (no sliding window)."""
        self.started = False
        """This call's first step has loaded the host's mask, positions and slot."""
        self.ahead = AHEAD if self.advance else 0
        """Greedy steps the GPU may run ahead of the host (`run_ahead`); 0: one step at a time."""
        self.device = dev
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.failed = False

    def bind(self, rows) -> None:
        """Serve the generate call of `rows` (built on this decoder's cache), from an empty cache."""
        self.rows, self.started = rows, False
        self.cache.offset = 0

    def _forward(self) -> torch.Tensor:
        with self.cache.static(self.slot):
            return self.step_fn(self.model, self.tokens, self.positions, self.mask, self.slot, self.cache,
                                self.advance)

    def _capture(self) -> None:
        state = [t.clone() for t in (self.tokens, self.positions, self.mask, self.slot)]
        warm_up(self._forward, self.device)  # writes this step's key/value at its slot: the replay writes the same
        for t, saved in zip((self.tokens, self.positions, self.mask, self.slot), state):
            t.copy_(saved)  # undo the warm-up's advances (its second slot stays masked until written)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._forward()
        self.graph = graph

    def _load_inputs(self) -> torch.Tensor:
        """Copy this step's mask, positions and slot from the host rows; returns the host mask (b, 1, 1, t)."""
        rows, cache = self.rows, self.cache
        mask = rows.next_token()  # (b, 1, 1, t) on the host; advances positions and valid
        t = mask.shape[-1]
        self.mask.copy_(F.pad(mask, (0, cache.max_len - t)), non_blocking=True)  # (b, 1, 1, L)
        self.positions.copy_(rows.positions, non_blocking=True)
        self.slot.fill_(cache.offset)
        return mask

    def step(self, token: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Feed `token` (b,) at the next slot: (logits (b, 1, vocab) float32, the step's host mask, or None
        where the replay advanced its own). The logits are None when capturing failed (at a call's first
        step); the caller then runs this step eagerly with the mask."""
        self.cache.check_room(1)
        mask = None
        if not (self.advance and self.started):
            mask = self._load_inputs()
            self.started = True
        self.tokens.copy_(token[:, None], non_blocking=True)
        if self.graph is None:
            try:
                self._capture()
            except Exception as e:  # noqa: BLE001 - eager decode still works; say why once
                log.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
                self.failed = True
                return None, mask
        self.graph.replay()
        self.cache.advance(1)
        return self.logits, mask

    def run_ahead(self, token: torch.Tensor, limit: int):
        """Greedy decode from `token` (b,): yields each step's tokens (b,) on the host, for at most `limit`
        steps. Each replay feeds itself the previous one's argmax on the device, so the host only reads
        tokens back, `ahead` steps behind the GPU, and never stalls it between steps. When the caller stops
        early (every row has finished: EOS or its length), the steps already queued were run for nothing (at
        most `ahead`); their cache slots lie past the call's end and are overwritten by the next call."""
        cuda = self.device.type == "cuda"
        b = self.tokens.shape[0]
        host = torch.empty(self.ahead + 1, b, dtype=torch.long, pin_memory=cuda)  # a ring of read-back rows
        queued: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        for i in range(limit):
            if i == 0:
                logits, mask = self.step(token)
                if logits is None:  # capturing failed: decode eagerly from here
                    yield from self._eager(token, mask, limit)
                    return
            else:
                self.cache.check_room(1)
                self.graph.replay()
                self.cache.advance(1)
            row = host[i % len(host)]
            row.copy_(self.tokens[:, 0], non_blocking=cuda)
            event = torch.cuda.Event() if cuda else None
            if event is not None:
                event.record(torch.cuda.current_stream(self.device))
            queued.append((row, event))
            if len(queued) > self.ahead:
                yield _read(*queued.pop(0))
        while queued:
            yield _read(*queued.pop(0))

    def _eager(self, token: torch.Tensor, mask: torch.Tensor, limit: int):
        """`run_ahead` without a graph: greedy eager steps from `token` (b,) and its mask (b, 1, 1, t)."""
        for i in range(limit):
            if i:
                mask = self.rows.next_token()
            logits = self.rows.forward(self.model, token[:, None], mask)  # (b, 1, vocab)
            token = logits[:, -1].argmax(-1).cpu()
            yield token


def _read(row: torch.Tensor, event) -> torch.Tensor:
    """The tokens in `row` (b,) once the copy recorded by `event` is done."""
    if event is not None:
        event.synchronize()
    return row.clone()
