"""OpenAI request bodies as pydantic models: the fields shardlm honours, each checked with its range.

Fields of the OpenAI API that shardlm does not implement are accepted only at their neutral value
(a client that sends `frequency_penalty: 0` works; one that asks for a penalty gets a 400 naming the
field). Unknown fields are ignored, as OpenAI-compatible servers do (clients send extras).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from shardlm.engine.requests import MAX_SEED, GenerationParams
from shardlm.engine.text import unicode_problem


def unicode_text(text: str) -> str:
    """`text` if it is Unicode text; a ValueError naming the first lone surrogate otherwise.

    JSON lets a string carry an escaped half of a surrogate pair on its own ("\\ud800"), which decodes to a Python
    str that no tokenizer takes and UTF-8 cannot encode: such a prompt had reached the tokenizer and come back as a
    500 (found by fuzzing the API)."""
    problem = unicode_problem(text)
    if problem:
        raise ValueError(f"{problem}; send UTF-8 text (a character past U+FFFF as both halves of its surrogate pair)")
    return text


Text = Annotated[str, AfterValidator(unicode_text)]
Prompt = Union[Text, list[Text], list[int], list[list[int]]]


class StreamOptions(BaseModel):
    """stream_options: whether the last chunk carries the usage."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class Sampling(BaseModel):
    """Fields both completions and chat take."""

    model_config = ConfigDict(extra="ignore")
    model: Text
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate at most")
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="-1 or 0: no limit")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: Text | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return [v] if isinstance(v, str) else v

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for a field asked at a value shardlm does not implement, else None."""
        neutral = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
        for name, value in neutral.items():
            if getattr(self, name) != value:
                return name, f"{name} is not supported; leave it at {value}"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported; leave it out"
        if self.best_of not in (None, 1) and self.best_of != self.n:
            return "best_of", "best_of is not supported; leave it out or equal to n"
        return None

    def params(self, max_tokens: int, logprobs: int | None = None, echo: bool = False,
               choice: int = 0) -> GenerationParams:
        """The engine's settings for choice `choice` (seeded choices draw different streams)."""
        seed = None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1)
        return GenerationParams(max_tokens, self.temperature, self.top_p, max(self.top_k, 0), seed,
                                tuple(self.stop or ()), tuple(self.stop_token_ids or ()), self.ignore_eos,
                                logprobs, echo)


class CompletionRequest(Sampling):
    """POST /v1/completions."""

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: Text | None = None


class ChatMessage(BaseModel):
    """One turn of a conversation."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _parts(cls, v):
        for part in v if isinstance(v, list) else ():
            if isinstance(part.get("text"), str):
                unicode_text(part["text"])
        return v

    def text(self) -> str:
        """The message's text (content parts of type text joined)."""
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=5)
    add_generation_prompt: bool = True
