"""Requests on the driver: what was asked, every token so far, and when each thing happened.

The driver owns requests; ranks own tensors. A request's prompt and generated tokens live here, so
it can be re-prefilled on any layout, and its stop conditions (length, end of sequence, stop strings,
stop token ids, cancellation) are decided here, after each step, from the tokens the ranks sampled.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass, field

from shardlm.runtime.protocol import SamplingParams

MAX_SEED = 2**63 - 1
_ids = itertools.count(1)


class RequestError(ValueError):
    """A request parameter outside its accepted range; `param` names it (for a 400 reply)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GenerationParams:
    """How one completion is generated (the OpenAI completion fields shardlm honours)."""

    max_tokens: int = 16
    """Tokens to generate at most."""
    temperature: float = 1.0
    """Softmax temperature; 0 picks the most likely token."""
    top_p: float = 1.0
    """Nucleus threshold in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    seed: int | None = None
    """Seed of this request's own random stream (None: drawn once at submission)."""
    stop: tuple[str, ...] = ()
    """Strings that end the completion (not included in its text)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the completion (included, as end-of-sequence is)."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens."""
    logprobs: int | None = None
    """Return the log-probability of each generated token and of the top `logprobs` alternatives (0..5)."""
    echo: bool = False
    """Return the prompt with the completion; with `logprobs`, the prompt tokens' log-probabilities too."""

    def validate(self, max_seq_len: int) -> None:
        """Raise RequestError naming the first parameter outside its range, with the range."""
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and 0 <= self.max_tokens <= max_seq_len,
             f"an integer in 0..{max_seq_len}"),
            ("temperature", _finite(self.temperature) and 0 <= self.temperature <= 100, "a number in [0, 100]"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and 0 <= self.top_k <= 10**7, "an integer >= 0 (0: no limit)"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED),
             f"an integer in 0..{MAX_SEED}"),
            ("stop", len(self.stop) <= 16 and all(0 < len(s) <= 256 for s in self.stop),
             "at most 16 non-empty strings of up to 256 characters"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 5),
             "an integer in 0..5"),
        ]
        for name, ok, accepted in checks:
            if not ok:
                raise RequestError(name, f"{name} must be {accepted}, got {getattr(self, name)!r}")

    def sampling(self) -> SamplingParams:
        """The rank-side sampling settings (the seed must be set by then)."""
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.seed or 0)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class TokenEvent:
    """What one step added to a request's stream."""

    token_ids: list[int]
    """The new tokens (empty in the final event of a request finished by a stop string or a cancel)."""
    text: str
    """Their text, held back while it could still be the start of a stop string."""
    logprobs: list[dict] | None = None
    """Per new token with `logprobs`: {"token_logprob": float, "top": {token id: logprob}}."""
    finish_reason: str | None = None
    """None while running; then "stop" (end of sequence, a stop string or id), "length", "cancelled" or "error"."""
    error: str | None = None
    """What went wrong, with finish_reason "error"."""


class StopText:
    """Incremental text of a request's tokens with stop strings applied: text is released only once it
    cannot be the beginning of a stop string, and a matched stop string ends the text before it.

    Each token decodes a short window, not the whole output (which would cost O(n^2) over a request):
    the tokens from `prefix` on, whose first part (up to `read`) was decoded before and gives the text
    the window's tail adds. The window keeps a few tokens of context, so tokenizers whose pieces depend
    on their neighbours (leading spaces) decode as the whole sequence would."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""
        self.released = 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.prefix = self.read = 0

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one token: (newly released text, True when a stop string was reached)."""
        self.ids.append(token_id)
        if self.tokenizer is None:  # a weights-only folder: token ids, no text (stops are refused at submit)
            return "", False
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        window = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if window.endswith("\ufffd") or len(window) <= len(before):  # an unfinished character, or no text yet
            return "", False
        self.text += window[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        text = self.text
        for s in self.stops:
            at = text.find(s, max(0, self.released - len(s)))
            if at >= 0:
                new, self.released = text[self.released:at], at
                return new, True
        safe = len(text) - self.hold if self.stops else len(text)
        new = text[self.released:safe] if safe > self.released else ""
        self.released = max(self.released, safe)
        return new, False

    def flush(self) -> str:
        """The held-back text, when the request ends without a stop string."""
        new, self.released = self.text[self.released:], len(self.text)
        return new


@dataclass
class Request:
    """One request as the driver tracks it from submission to its last token."""

    prompt_ids: list[int]
    params: GenerationParams
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = field(default_factory=time.monotonic)
    slot: int | None = None
    """The KV-cache slot it holds while admitted."""
    prefilled: int = 0
    """Prompt tokens sent to its slot's cache (in a step that ran, or one under way)."""
    shared: int = 0
    """Of those, tokens whose keys and values were copied from another request's slot (Scheduler's prefix
    sharing) instead of computed."""
    output_ids: list[int] = field(default_factory=list)
    pending: int = 0
    """Tokens asked of steps under way whose results the driver has not applied yet (see Scheduler)."""
    finish_reason: str | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    prompt_logprobs: list[dict] = field(default_factory=list)
    """With echo and logprobs: per prompt token after the first, its logprob and the top alternatives."""
    events: "queue.Queue[TokenEvent]" = field(default_factory=queue.Queue)
    """Its events, in order (when no `sink` is given)."""
    sink: "queue.Queue | None" = None
    """A queue shared by several requests: gets (request, event) pairs instead of `events`."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    stop_text: StopText | None = None
    _notify: "object | None" = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def deliver(self, event: TokenEvent) -> None:
        """Hand one event to whoever reads this request (called on the scheduler thread)."""
        with self._lock:
            if self._notify is not None:
                self._notify(event)
            elif self.sink is not None:
                self.sink.put((self, event))
            else:
                self.events.put(event)

    def listen(self, notify) -> list[TokenEvent]:
        """From now on call `notify(event)` for each event instead of queueing it; returns the events queued
        before (for an asyncio reader, which cannot block on `events`)."""
        with self._lock:
            self._notify = notify
            earlier = []
            while not self.events.empty():
                earlier.append(self.events.get_nowait())
            return earlier

    @property
    def done_prefill(self) -> bool:
        """Every prompt token is in the cache, or in a step under way."""
        return self.prefilled >= len(self.prompt_ids)

    @property
    def length(self) -> int:
        """Prompt plus generated tokens the driver has seen."""
        return len(self.prompt_ids) + len(self.output_ids)

    def cancel(self) -> None:
        """Ask the engine to stop this request at the next step boundary (its slot is freed)."""
        self.cancelled.set()
