"""One engine step as the driver hands it to every rank: which slots prefill which tokens, which decode.

Plain picklable records that import no torch (the driver builds them; the ranks run them). A step
is iteration-level: requests join and leave between steps, each in its own KV-cache slot, so a
step's rows may be at different positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.runtime.protocol import SamplingParams


@dataclass(frozen=True)
class SlotStart:
    """A request takes a slot: its sampling stream starts from `seed`."""

    slot: int
    seed: int


@dataclass(frozen=True)
class Prefill:
    """A chunk of one request's prompt: `tokens` at positions [start, start + len(tokens)) of `slot`."""

    slot: int
    tokens: tuple[int, ...]
    start: int
    sample: bool
    """The chunk ends the prompt: sample the request's first token from its last position."""
    params: SamplingParams
    logprobs: int | None = None
    """With `sample`: the sampled token's logprob and the top `logprobs` alternatives."""
    prompt_logprobs: bool = False
    """Logprobs of the chunk's own tokens after its first (echo): each position predicts the next."""
    next_token: int | None = None
    """The prompt token after this chunk (for the last position's prompt logprob when the chunk does not end
    the prompt)."""


@dataclass(frozen=True)
class SlotCopy:
    """Keys and values at positions [start, end) of slot `src` copied into slot `dst` before the step's prefills:
    a prompt prefix another request's slot holds already (engine/scheduler.py's prefix sharing)."""

    src: int
    dst: int
    start: int
    end: int


@dataclass(frozen=True)
class Decode:
    """One new token of a running request: `token` goes in at `position` of `slot` and the next is sampled.
    `token` None: the token the ranks sampled for this slot in the step before, which the driver has not seen
    yet (it sent this step before that one's result came back; see Scheduler's pipelining)."""

    slot: int
    token: int | None
    position: int
    params: SamplingParams
    logprobs: int | None = None


@dataclass(frozen=True)
class Step:
    """Everything the ranks run between two step boundaries."""

    id: int
    starts: tuple[SlotStart, ...] = ()
    prefills: tuple[Prefill, ...] = ()
    decodes: tuple[Decode, ...] = ()
    repeat: int = 1
    """The decode rows run this many times: each run after the first feeds every row the token the run before
    sampled for it, at the next position (a run of greedy or seeded tokens in one message each way)."""
    report_stats: bool = False
    """Every rank sends its counters (`rank_stats`) after this step: a poll asked for them, and riding on a step
    costs no round trip of its own between two steps."""
    copies: tuple[SlotCopy, ...] = ()
    """Prompt prefixes copied from slot to slot first (each comes with a prefill of its `dst` in the same step)."""

    @property
    def empty(self) -> bool:
        """No work (the engine then waits for requests without touching the ranks)."""
        return not self.prefills and not self.decodes


@dataclass
class Sampled:
    """What a step produced for one slot."""

    token: int | None = None
    """The sampled token (None for a prefill chunk that does not end its prompt)."""
    logprob: dict | None = None
    """{"token_logprob": float, "top": {token id: logprob}} for the sampled token, when asked."""
    prompt_logprobs: list | None = None
    """Per chunk position after the first (and the next chunk's first token when known): its logprob dict."""


@dataclass
class StepResult:
    """The step's outcome, reported by the rank that holds the LM head's full logits (rank 0 of the last stage)."""

    id: int
    slots: dict[int, Sampled]
    seconds: float = 0.0
    """Wall time of the step on that rank."""
    later: list[dict[int, Sampled]] = field(default_factory=list)
    """With `Step.repeat` > 1: what each decode run after the first produced, in order."""
