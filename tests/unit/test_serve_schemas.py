"""Request bodies of `shardlm serve` checked without a server: text that is not Unicode (a lone surrogate, which JSON
escapes allow) is a 400 naming the field and the character, and a union's type errors do not hide it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shardlm.serve.errors import validation_message
from shardlm.serve.schemas import ChatRequest, CompletionRequest


def _message(cls, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as e:
        cls.model_validate(body)
    return validation_message(e.value.errors(include_url=False))


@pytest.mark.parametrize("cls,body,param,code", [
    (CompletionRequest, {"model": "m", "prompt": "caf\ud800"}, "prompt", "U+D800 at character 3"),
    (CompletionRequest, {"model": "m", "prompt": ["ok", "x\udfff"]}, "prompt.1", "U+DFFF at character 1"),
    (CompletionRequest, {"model": "m", "prompt": "ok", "stop": ["a", "\ud83d"]}, "stop.1", "U+D83D"),
    (CompletionRequest, {"model": "m", "prompt": "ok", "suffix": "\udbff"}, "suffix", "U+DBFF"),
    (CompletionRequest, {"model": "m\ud800", "prompt": "ok"}, "model", "U+D800"),
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content", "U+D800"),
    (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
     "messages.0.content", "U+DC00"),
])
def test_a_lone_surrogate_is_named_with_its_field(cls, body, param, code):
    message, got = _message(cls, body)
    assert got == param and code in message and "not Unicode text" in message, message
    message.encode("utf-8")  # the reply itself must be sendable


def test_whole_surrogate_pairs_and_other_errors_are_unchanged():
    body = {"model": "m", "prompt": ["caf\u00e9", "\U0001F600"]}
    assert CompletionRequest.model_validate(body).prompt[1] == "\U0001F600"
    assert _message(CompletionRequest, {"model": "m", "prompt": "ok", "stop": 5}) == (
        "stop: Input should be a valid string (got 5)", "stop")
    assert _message(CompletionRequest, {"model": "m", "prompt": "ok", "temperature": -1})[1] == "temperature"
