"""POST /v1/completions: prompts as text, lists of text, token ids or lists of them; OpenAI's legacy shape."""

from __future__ import annotations

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from shardlm.engine.requests import TokenEvent
from shardlm.serve.calls import Call, Choice, collect, stream_body
from shardlm.serve.errors import ApiError
from shardlm.serve.schemas import CompletionRequest

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions."""


def prompt_ids(body: CompletionRequest, tokenizer) -> list[list[int]]:
    """Every prompt of the body as token ids (text is tokenized with the model's tokenizer)."""
    p = body.prompt
    if isinstance(p, str):
        return [tokenizer(p)["input_ids"]]
    if not p:
        raise ApiError(400, "prompt is empty; give text, a list of texts, token ids or a list of them", "prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if all(isinstance(x, str) for x in p):
        return [tokenizer(x)["input_ids"] for x in p]
    return [list(x) for x in p]


def logprobs_object(c: Choice, tokenizer, prompt: list[int] | None, prompt_lp: list[dict]) -> dict:
    """OpenAI's completion logprobs: tokens, token_logprobs, top_logprobs, text_offset (prompt first with echo)."""
    ids, lps, tops = [], [], []
    if prompt is not None:
        ids += prompt
        lps += [None] + [e["token_logprob"] for e in prompt_lp]
        tops += [None] + [e["top"] for e in prompt_lp]
    ids += c.token_ids
    lps += [e["token_logprob"] for e in c.logprobs]
    tops += [e["top"] for e in c.logprobs]
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = [None if d is None else {tokenizer.decode([int(k)]): v for k, v in d.items()} for d in tops]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


async def complete(service, body: CompletionRequest, http: HttpRequest):
    """Answer one completions call (a JSON reply, or an SSE stream with `stream`)."""
    engine, tok = service.engine, service.engine.tokenizer
    service.check_model(body.model)
    if (bad := body.unsupported()) is not None:
        raise ApiError(400, bad[1], bad[0])
    if body.suffix:
        raise ApiError(400, "suffix is not supported; leave it out", "suffix")
    prompts = prompt_ids(body, tok)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    call = Call(engine, body.model, "cmpl")
    call.submit(prompts, body.n, lambda j: body.params(max_tokens, body.logprobs, body.echo, j))
    base = {"id": call.id, "object": "text_completion", "created": call.created, "model": body.model}
    if body.stream:
        first = set()

        def chunks(c: Choice, event: TokenEvent) -> list[dict]:
            text = event.text
            if body.echo and c.index not in first:
                first.add(c.index)
                text = tok.decode(prompts[c.prompt]) + text
            lp = logprobs_object(_one(c, event), tok, None, []) if body.logprobs is not None and event.token_ids \
                else None
            return [{**base, "choices": [{"index": c.index, "text": text, "logprobs": lp,
                                          "finish_reason": event.finish_reason}]}]

        usage = base | {"choices": []} if body.stream_options and body.stream_options.include_usage else None
        return StreamingResponse(stream_body(call, chunks, usage), media_type="text/event-stream")
    if not await collect(call, http):
        return JSONResponse({}, status_code=499)
    call.check_failed()
    choices = []
    for c in call.choices:
        prompt = prompts[c.prompt] if body.echo else None
        text = (tok.decode(prompt) if prompt is not None else "") + c.text
        lp = logprobs_object(c, tok, prompt, c.req.prompt_logprobs) if body.logprobs is not None else None
        choices.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
    return JSONResponse({**base, "choices": choices, "usage": call.usage()})


def _one(c: Choice, event: TokenEvent) -> Choice:
    """A choice holding only one event's tokens (for a stream chunk's logprobs)."""
    return Choice(c.index, c.prompt, c.req, event.text, list(event.token_ids), list(event.logprobs or []))
