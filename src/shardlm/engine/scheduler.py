"""Iteration-level scheduling on the driver: admit and retire requests at every step boundary.

Each step the scheduler (1) retires cancelled requests and frees their slots, (2) admits waiting requests into free
KV-cache slots, first come first served, (3) gives every running request whose prompt is in the cache one decode
token, and (4) spends the step's prefill budget (the Plan's `kv_cache.prefill_chunk` tokens) on pending prompts in
admission order, a chunk at a time. So a long prompt delays the running streams by at most one chunk per step, and
the KV cache is the Plan's `max_batch` slots of `max_seq_len` tokens, allocated once on the ranks and reused. Chunks
fill the step's budget (a prompt's chunk may be cut short by what the prompts before it took, but never leaves one
token for the next: a chunk of one token runs as a decode row, whose sums are ordered otherwise, so the prompt's
first token would depend on the other prompts), unless `anchored`: then a prompt's chunks are its own `[k *
prefill_chunk, (k + 1) * prefill_chunk)` whatever else is pending, and a chunk that does not fit what is left of the
budget waits for the next step (later, shorter ones may fill the gap; the first prompt still prefilling always
fits). The engine anchors chunks where the ranks run each chunk in a pass of its own (one GPU,
SHARDLM_BATCH_INVARIANT): a GPU's products pick their kernels by shape, so a chunk's prefill numbers then do not
depend on the other requests.

Steps may be pipelined: the engine plans and sends step n + 1 before it applies step n's result, so the
driver's work between steps (streaming tokens, stop strings, the next plan) overlaps the ranks' compute
instead of adding to it. A request whose last token is still under way then decodes the token the ranks
kept for its slot (`Decode.token` None), and counts it in `pending` until the result comes back; a step
never asks a request for more than `max_tokens` or `max_seq_len` allow. A request that ends on a token the
driver sees late (end of sequence, a stop string, cancellation) may have one more row computed in the step
under way; its result is dropped, and its slot's next owner starts in a later step, so the rows of other
requests never change. Each step remembers which request asked for each slot, so a result is credited to
that request even when its slot has changed hands since.

A step may decode several tokens a row (`decode_run`, Step.repeat): while no prompt waits or is prefilling, the
ranks run the step's decode rows up to `decode_run` times, feeding each row the token they sampled for it in the
run before, and send every run's tokens back in one result. Each row's tokens are the ones single steps give (the
same rows, positions and random streams); the run stops where the first row would pass its max_tokens or
max_seq_len, and tokens a row sampled after its ending (end of sequence, a stop string) are dropped, as a late
row of a pipelined step is. A request cancelled while its run is under way gets the run's first token, as it would
from a single step, and no more; tokens applied before the cancellation stand (a request whose run reached its
max_tokens before it was cancelled ends with "length").

Prompts share their common prefixes: where another running request's slot holds the keys and values of a prompt's
next tokens already (the n choices of one call, a system prompt many requests begin with), the step copies them from
slot to slot (Step.copies, run before its prefills) instead of computing them again, and the prompt's prefill goes
on from there; at least its last two tokens are its own (the last one's logits give its first token). A prompt whose
next MIN_SHARED tokens or more another request computes in the same step waits for the next step and copies them.
Copied keys and values are the bits the request's own prefill would write (a position's keys and values depend on
the tokens up to it only, and a prefill chunk's rows do not depend on where the chunk starts); with anchored chunks
the copy ends on a chunk boundary, so every chunk a prompt computes is the one it would compute alone. A request
that asks for its prompt's logprobs (echo) computes its whole prompt. A slot keeps the prompt its last request
prefilled after that request ends, until its next request writes over it: a waiting request takes the free slot
whose kept prompt it shares most of (its prefill then starts after those tokens, nothing copied), and running ones
may copy from it, so a conversation's next turn or a system prompt sent again computes only what is new (within the
slots; no cache beyond them).
"""

from __future__ import annotations

import random
import time
from collections import deque

from shardlm.engine.requests import Request, TokenEvent
from shardlm.runtime.work import Decode, Prefill, Sampled, SlotCopy, SlotStart, Step, StepResult

MIN_SHARED = 16
"""Fewest prompt tokens worth copying from another request's slot, or waiting a step for (prefix sharing)."""


class Scheduler:
    """Requests waiting and running, the free slots, and the step that comes next."""

    def __init__(self, slots: int, max_seq_len: int, prefill_chunk: int, eos_ids: tuple[int, ...],
                 anchored: bool = False, decode_run: int = 1):
        self.max_seq_len, self.prefill_chunk, self.eos_ids = max_seq_len, prefill_chunk, eos_ids
        self.decode_run = decode_run
        """At most this many decode tokens a row in one step, when no prompt waits (see the module docstring)."""
        self.anchored = anchored
        """Prompt chunks start at multiples of `prefill_chunk` (see the module docstring)."""
        self.share_prefixes = True
        """Prompts copy the prefixes other requests' slots hold (see the module docstring); off: each computes its
        own (bench/prefix_sharing.py compares the two)."""
        self.free = list(range(slots - 1, -1, -1))  # pop() takes the lowest slot
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_id = 0
        self.finished_by_reason: dict[str, int] = {}
        self.held: dict[int, list[int]] = {}
        """Per free slot, the prompt tokens whose keys and values its last request's prefill left in it (until the
        slot's next request writes over them): what later prompts may share. Decode positions are not kept: a
        decode row's sums are ordered otherwise than a prefill's."""
        self._owners: dict[int, dict[int, Request]] = {}
        """Per step not yet applied: the request that asked for each slot's work."""
        self.observer = None
        """Optional: `token(req, now)` before each emitted token, `finish(req, reason, now)` (serve/metrics.py)."""

    @property
    def slots(self) -> int:
        """Slots in all."""
        return len(self.free) + len(self.running)

    def add(self, req: Request) -> None:
        """Queue a request (already validated against the plan's limits)."""
        self.waiting.append(req)

    def idle(self) -> bool:
        """Nothing waits and nothing runs."""
        return not self.waiting and not self.running

    def prompt_work(self) -> bool:
        """Whether a waiting request could take a free slot, or an admitted prompt is not all prefilled."""
        return bool(self.waiting and self.free) or any(not r.done_prefill for r in self.running)

    def next_step(self) -> Step:
        """Retire cancelled requests, admit waiting ones, and plan the next step's work (the step before may
        still be under way, see the module docstring)."""
        self._retire_cancelled()
        self.release()
        starts = self._admit()
        rows = [r for r in self.running if self._may_decode(r)]
        repeat = self._repeat(rows)
        decodes = tuple(self._decode(r, repeat) for r in rows)  # before the prefills move on
        prefills, copies = self._prefills()
        self.step_id += 1
        if prefills or decodes:
            self._owners[self.step_id] = {r.slot: r for r in self.running}
        return Step(self.step_id, tuple(starts), prefills, decodes, repeat, copies=copies)

    def _repeat(self, rows: list[Request]) -> int:
        """Decode runs for this step: 1 while a prompt waits or is prefilling, else up to `decode_run`, as far as
        every row may go (max_tokens, max_seq_len)."""
        if self.decode_run <= 1 or not rows or self.waiting or self.prompt_work():
            return 1
        room = min(min(r.params.max_tokens - len(r.output_ids) - r.pending,
                       self.max_seq_len - r.length - r.pending) for r in rows)
        return max(1, min(self.decode_run, room))

    def _may_decode(self, r: Request) -> bool:
        """Its prompt is in (or under way) and its next token is wanted: a step never decodes past the limits."""
        made = len(r.output_ids) + r.pending
        return (r.finish_reason is None and r.done_prefill and made > 0 and made < r.params.max_tokens
                and r.length + r.pending < self.max_seq_len)

    def _decode(self, r: Request, repeat: int) -> Decode:
        """Its next decode row: the last token it produced, or (still under way) the one its slot holds."""
        token = r.output_ids[-1] if r.pending == 0 else None
        position = r.length + r.pending - 1
        r.pending += repeat
        return Decode(r.slot, token, position, r.params.sampling(), r.params.logprobs)

    def _retire_cancelled(self) -> None:
        for r in list(self.waiting):
            if r.cancelled.is_set():
                self.waiting.remove(r)
                self._finish(r, "cancelled")
        for r in list(self.running):
            if r.cancelled.is_set() and r.finish_reason is None:
                self._finish(r, "cancelled")

    def _admit(self) -> list[SlotStart]:
        starts = []
        while self.waiting and self.free:
            r = self.waiting.popleft()
            r.slot, r.admitted_at = self._free_slot(r), time.monotonic()
            if r.params.seed is None:
                r.params = _with_seed(r.params, random.randrange(2**62))
            self.running.append(r)
            starts.append(SlotStart(r.slot, r.params.seed))
        return starts

    def _free_slot(self, r: Request) -> int:
        """A free slot for r: the one whose earlier request's prompt r shares most of (MIN_SHARED tokens or more: r's
        prefill starts after them, nothing copied), else the last freed that keeps no prompt, else the last freed."""
        empty = [i for i, slot in enumerate(self.free) if not self.held.get(slot)]
        at, best = empty[-1] if empty else len(self.free) - 1, 0
        if self._may_share(r):
            for i, slot in enumerate(self.free):
                held = self.held.get(slot, [])
                common = self._common(r, held, len(held))
                if common > best:
                    at, best = i, common
        slot = self.free.pop(at)
        self.held.pop(slot, None)  # its next request writes over what the slot held after those tokens
        r.prefilled = r.shared = best
        return slot

    def _prefills(self) -> tuple[tuple[Prefill, ...], tuple[SlotCopy, ...]]:
        """This step's prompt chunks, in admission order, within the budget (see the module docstring), and the
        prompt prefixes copied from slot to slot before them."""
        budget, out, copies = self.prefill_chunk, [], []
        ready = {id(s): s.prefilled for s in self.running}  # what the steps before this one write
        for r in self.running:
            if budget <= 0:
                break
            if r.done_prefill or r.finish_reason is not None:
                continue
            src, shared, wait = self._share(r, ready)
            if wait:
                continue  # a prompt planned before it in this step computes its next tokens: copy them next step
            left = len(r.prompt_ids) - shared
            n = min(self.prefill_chunk, left) if self.anchored else min(budget, left)
            if not self.anchored and left - n == 1:
                n -= 1  # a last chunk of one token would run as a decode row (other sums): leave it two
            if n <= 0 or n > budget:
                continue  # its next chunk waits for a step with room for it (anchored: for all of it)
            if src is not None:
                copies.append(SlotCopy(src, r.slot, r.prefilled, shared))
                r.shared += shared - r.prefilled
            start, end = shared, shared + n
            last = end == len(r.prompt_ids)
            p = r.params
            out.append(Prefill(r.slot, tuple(r.prompt_ids[start:end]), start, last and p.max_tokens > 0,
                               p.sampling(), p.logprobs, p.echo and p.logprobs is not None,
                               None if last else r.prompt_ids[end]))
            r.prefilled = end
            r.pending += out[-1].sample
            budget -= n
        return tuple(out), tuple(copies)

    def _share(self, r: Request, ready: dict[int, int]) -> tuple[int | None, int, bool]:
        """Prefix sharing for r's next tokens (see the module docstring): (the slot that holds the most of them after
        the steps before this one, or None; where r's prefill goes on from; whether r waits a step because a request
        planned before it in this step computes MIN_SHARED of them or more)."""
        if not self._may_share(r):
            return None, r.prefilled, False
        src, best, coming = None, r.prefilled, r.prefilled
        sources = [(s.slot, s.prompt_ids, ready[id(s)], s.prefilled) for s in self.running
                   if s is not r and s.finish_reason is None]
        sources += [(slot, held, len(held), len(held)) for slot, held in self.held.items()]
        for slot, tokens, have, will in sources:
            common = self._common(r, tokens, will)
            if min(common, have) > best:
                src, best = slot, min(common, have)
            coming = max(coming, common)
        if best - r.prefilled >= MIN_SHARED:
            return src, best, False
        return None, r.prefilled, coming - r.prefilled >= MIN_SHARED

    def _may_share(self, r: Request) -> bool:
        """Sharing is on, and r does not ask for its prompt's logprobs."""
        return self.share_prefixes and not (r.params.echo and r.params.logprobs is not None)

    def _common(self, r: Request, tokens: list[int], upto: int) -> int:
        """How many of r's first prompt tokens equal `tokens`' first (of `upto`) and may be shared: its last two
        tokens are its own (a chunk of one runs as a decode row); anchored, down to a chunk boundary."""
        limit = min(len(r.prompt_ids) - 2, upto)
        if limit - r.prefilled < MIN_SHARED:
            return 0
        common = _common_prefix(r.prompt_ids, tokens, limit)
        return common - common % self.prefill_chunk if self.anchored else common

    def apply(self, step: Step, result: StepResult, tokenizer) -> list[Request]:
        """Record what a step produced; returns the requests that finished (their slots are free again)."""
        now = time.monotonic()
        owners = self._owners.pop(step.id, {})
        for p in step.prefills:
            r = owners[p.slot]
            r.pending -= p.sample
            if r.finish_reason is not None:  # cancelled while the step ran
                continue
            got = result.slots.get(p.slot, Sampled())
            if got.prompt_logprobs:
                r.prompt_logprobs.extend(got.prompt_logprobs)
            if p.sample:
                self._emit(r, got, now, tokenizer)
            elif p.start + len(p.tokens) == len(r.prompt_ids) and r.params.max_tokens == 0:
                self._finish(r, "length")
        for d in step.decodes:
            r = owners[d.slot]
            r.pending -= step.repeat
            for i, got in enumerate([result.slots[d.slot]] + [run[d.slot] for run in result.later]):
                if r.finish_reason is not None or (i and r.cancelled.is_set()):
                    break  # it ended on an earlier token, or was cancelled: this row's later results are dropped
                self._emit(r, got, now, tokenizer)
        return self.release()

    def release(self) -> list[Request]:
        """Take finished requests out of the running set and free their slots; returns them."""
        done = [r for r in self.running if r.finish_reason is not None]
        for r in done:
            self.running.remove(r)
            self.free.append(r.slot)
            self.held[r.slot] = r.prompt_ids[:r.prefilled]
        return done

    def _emit(self, r: Request, got: Sampled, now: float, tokenizer) -> None:
        """Append a sampled token, decide whether the request is finished, and stream the event."""
        token = got.token
        if self.observer is not None:
            self.observer.token(r, now)
        r.output_ids.append(token)
        r.first_token_at = r.first_token_at or now
        r.last_token_at = now
        if r.stop_text is None:
            from shardlm.engine.requests import StopText
            r.stop_text = StopText(tokenizer, r.params.stop)
        text, hit_stop = r.stop_text.push(token)
        reason = None
        if hit_stop or token in r.params.stop_token_ids or (token in self.eos_ids and not r.params.ignore_eos):
            reason = "stop"
        elif len(r.output_ids) >= r.params.max_tokens or r.length >= self.max_seq_len:
            reason = "length"
        if reason is not None and not hit_stop:
            text += r.stop_text.flush()
        r.deliver(TokenEvent([token], text, [got.logprob] if got.logprob else None, reason))
        if reason is not None:
            r.finish_reason = reason
            self._count(r, reason)

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        """End a request that produced no token this step (cancelled, failed, or nothing to generate)."""
        if r.finish_reason is not None:
            return
        r.finish_reason = reason
        tail = r.stop_text.flush() if r.stop_text is not None and reason != "cancelled" else ""
        r.deliver(TokenEvent([], tail, None, reason, error))
        self._count(r, reason)

    def _count(self, r: Request, reason: str) -> None:
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        if self.observer is not None:
            self.observer.finish(r, reason, time.monotonic())

    def cancel_all(self) -> None:
        """End every request with finish_reason "cancelled" (the engine is closing)."""
        for r in list(self.waiting) + self.running:
            self._finish(r, "cancelled")
        self.waiting.clear()
        self.release()

    def fail_all(self, error: str) -> None:
        """End every request with finish_reason "error" (the engine lost a rank)."""
        for r in list(self.waiting) + self.running:
            self._finish(r, "error", error)
        self.waiting.clear()
        self._owners.clear()
        self.release()
        self.held.clear()  # nothing the lost ranks held is known any more


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of a's and b's common prefix, at most `limit`: blocks of 256 compared as list slices, then a
    binary search in the first block that differs (whole-prefix slices copy the lists: 10x slower on long prompts,
    bench/RESULTS.md stop 62)."""
    n = max(0, min(limit, len(a), len(b)))
    for i in range(0, n, 256):
        j = min(n, i + 256)
        if a[i:j] != b[i:j]:
            lo, hi = i, j  # a[:lo] == b[:lo], a[lo:hi] != b[lo:hi]
            while lo < hi - 1:
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
    return n


def _with_seed(params, seed: int):
    from dataclasses import replace

    return replace(params, seed=seed)
