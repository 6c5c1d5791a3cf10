"""One HTTP call's engine requests: submit, follow their events, cancel when the client goes away.

Each prompt (and each of its `n` choices) is one engine request. A streaming reply is Server-Sent
Events, one `data:` chunk per event of each choice, an optional usage chunk, then `data: [DONE]`.
A client that goes away (a closed stream, or a disconnect while a plain reply is being built)
cancels its requests, which frees their KV-cache slots at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import Request as HttpRequest

from shardlm.engine.requests import GenerationParams, Request, TokenEvent
from shardlm.serve.errors import ApiError, error_response, submit_error


@dataclass
class Choice:
    """One choice as it is built: its engine request and what it produced so far."""

    index: int
    prompt: int
    req: Request
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    def add(self, event: TokenEvent) -> None:
        """Fold one event in."""
        self.text += event.text
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs or []
        self.finish_reason = event.finish_reason or self.finish_reason
        self.error = event.error or self.error


class Call:
    """The requests of one HTTP call and their progress."""

    def __init__(self, engine, model: str, prefix: str):
        self.engine, self.model = engine, model
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices: list[Choice] = []
        self.prompt_tokens = 0

    def submit(self, prompts: list[list[int]], n: int, params_for: Callable[[int], GenerationParams]) -> None:
        """Submit every prompt x n choices; on a refusal cancel what was submitted and raise ApiError."""
        try:
            for p, ids in enumerate(prompts):
                self.prompt_tokens += len(ids)
                for j in range(n):
                    self.choices.append(Choice(p * n + j, p, self.engine.submit(ids, params_for(j))))
        except Exception as e:
            self.cancel()
            raise submit_error(e) from e

    def cancel(self) -> None:
        """Cancel every unfinished request of the call."""
        for c in self.choices:
            if c.finish_reason is None:
                self.engine.cancel(c.req)

    async def events(self) -> AsyncIterator[tuple[Choice, TokenEvent]]:
        """Every choice's events as they come, interleaved, each folded into its choice first."""
        loop = asyncio.get_running_loop()
        box: asyncio.Queue = asyncio.Queue()
        for c in self.choices:
            for earlier in c.req.listen(lambda e, c=c: loop.call_soon_threadsafe(box.put_nowait, (c, e))):
                box.put_nowait((c, earlier))
        left = len(self.choices)
        while left:
            c, event = await box.get()
            c.add(event)
            left -= event.finish_reason is not None
            yield c, event

    def usage(self) -> dict:
        """OpenAI's usage object."""
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def check_failed(self) -> None:
        """ApiError 500, naming what failed, when the engine ended a choice with an error."""
        failed = next((c for c in self.choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise ApiError(500, f"generation failed: {failed.error or 'the engine stopped'}")


async def collect(call: Call, http: HttpRequest) -> bool:
    """Wait until every choice has finished; False when the client disconnected first (the call is cancelled)."""
    stream = call.events().__aiter__()
    try:
        while True:
            nxt = asyncio.ensure_future(stream.__anext__())
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=0.5)
                if done:
                    break
                if await http.is_disconnected():
                    nxt.cancel()
                    call.cancel()
                    return False
            try:
                nxt.result()
            except StopAsyncIteration:
                return True
    finally:
        await stream.aclose()


def sse(data: dict | str) -> str:
    """One Server-Sent Events message."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def stream_body(call: Call, chunk_for: Callable[[Choice, TokenEvent], list[dict]],
                      usage_chunk: dict | None) -> AsyncIterator[str]:
    """An SSE body: chunks per event, the usage chunk when given (completed at the end), then [DONE]. A client
    that goes away ends the generator early, which cancels its requests. A failure (a rank died) ends the
    stream with one `data: {"error": ...}` message (the status line has been sent already), then [DONE]."""
    try:
        async for c, event in call.events():
            if event.finish_reason == "error":
                body = error_response(500, f"generation failed: {event.error or 'the engine stopped'}").body
                yield sse(body.decode())
                break
            for chunk in chunk_for(c, event):
                yield sse(chunk)
        else:
            if usage_chunk is not None:
                yield sse({**usage_chunk, "usage": call.usage()})
        yield sse("[DONE]")
    finally:
        call.cancel()  # no-op for finished choices; frees the slots of a client that went away
