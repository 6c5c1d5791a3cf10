"""Iteration-level scheduling on the driver: admit and retire requests at every step boundary.

Each step the scheduler (1) retires cancelled requests and frees their slots, (2) admits waiting
requests into free KV-cache slots, first come first served, (3) gives every running request whose
prompt is in the cache one decode token, and (4) spends the step's prefill budget (the Plan's
`kv_cache.prefill_chunk` tokens) on pending prompts in admission order, a chunk at a time. So a long
prompt delays the running streams by at most one chunk per step, and the KV cache is the Plan's
`max_batch` slots of `max_seq_len` tokens, allocated once on the ranks and reused.
"""

from __future__ import annotations

import random
import time
from collections import deque

from shardlm.engine.requests import Request, TokenEvent
from shardlm.runtime.work import Decode, Prefill, Sampled, SlotStart, Step, StepResult


class Scheduler:
    """Requests waiting and running, the free slots, and the step that comes next."""

    def __init__(self, slots: int, max_seq_len: int, prefill_chunk: int, eos_ids: tuple[int, ...]):
        self.max_seq_len, self.prefill_chunk, self.eos_ids = max_seq_len, prefill_chunk, eos_ids
        self.free = list(range(slots - 1, -1, -1))  # pop() takes the lowest slot
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_id = 0
        self.finished_by_reason: dict[str, int] = {}
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

    def next_step(self) -> Step:
        """Retire cancelled requests, admit waiting ones, and plan the next step's work."""
        self._retire_cancelled()
        self.release()
        starts = self._admit()
        decodes = tuple(Decode(r.slot, r.output_ids[-1], r.length - 1, r.params.sampling(), r.params.logprobs)
                        for r in self.running if r.done_prefill and r.output_ids and r.finish_reason is None)
        self.step_id += 1
        return Step(self.step_id, tuple(starts), self._prefills(), decodes)

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
            r.slot, r.admitted_at = self.free.pop(), time.monotonic()
            if r.params.seed is None:
                r.params = _with_seed(r.params, random.randrange(2**62))
            self.running.append(r)
            starts.append(SlotStart(r.slot, r.params.seed))
        return starts

    def _prefills(self) -> tuple[Prefill, ...]:
        budget, out = self.prefill_chunk, []
        for r in self.running:
            if budget <= 0:
                break
            if r.done_prefill or r.finish_reason is not None:
                continue
            n = min(budget, len(r.prompt_ids) - r.prefilled)
            start, end = r.prefilled, r.prefilled + n
            last = end == len(r.prompt_ids)
            p = r.params
            out.append(Prefill(r.slot, tuple(r.prompt_ids[start:end]), start, last and p.max_tokens > 0,
                               p.sampling(), p.logprobs, p.echo and p.logprobs is not None,
                               None if last else r.prompt_ids[end]))
            budget -= n
        return tuple(out)

    def apply(self, step: Step, result: StepResult, tokenizer) -> list[Request]:
        """Record what a step produced; returns the requests that finished (their slots are free again)."""
        now = time.monotonic()
        for p in step.prefills:
            r = self._holder(p.slot)
            r.prefilled = p.start + len(p.tokens)
            got = result.slots.get(p.slot, Sampled())
            if got.prompt_logprobs:
                r.prompt_logprobs.extend(got.prompt_logprobs)
            if p.sample:
                self._emit(r, got, now, tokenizer)
            elif r.done_prefill and r.params.max_tokens == 0:
                self._finish(r, "length")
        for d in step.decodes:
            r = self._holder(d.slot)
            if r.finish_reason is None:
                self._emit(r, result.slots[d.slot], now, tokenizer)
        return self.release()

    def release(self) -> list[Request]:
        """Take finished requests out of the running set and free their slots; returns them."""
        done = [r for r in self.running if r.finish_reason is not None]
        for r in done:
            self.running.remove(r)
            self.free.append(r.slot)
        return done

    def _holder(self, slot: int) -> Request:
        return next(r for r in self.running if r.slot == slot)

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
        self.release()


def _with_seed(params, seed: int):
    from dataclasses import replace

    return replace(params, seed=seed)
