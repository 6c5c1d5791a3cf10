"""POST /v1/chat/completions: the model's chat template over the messages, then the same engine requests."""

from __future__ import annotations

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from shardlm.engine.chat_template import BrokenChatTemplateError, ChatTemplateError
from shardlm.engine.requests import TokenEvent
from shardlm.engine.text import template_ids
from shardlm.serve.calls import Call, Choice, collect, stream_body
from shardlm.serve.errors import ApiError
from shardlm.serve.schemas import ChatRequest


def chat_ids(body: ChatRequest, tokenizer) -> list[int]:
    """The conversation as token ids, through the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        return template_ids(tokenizer, messages, body.add_generation_prompt)
    except BrokenChatTemplateError as e:  # the server's model folder is at fault, not the request
        raise ApiError(500, str(e)) from e
    except ChatTemplateError as e:  # the template's raise_exception: e.g. roles must alternate
        raise ApiError(400, f"the model's chat template refused these messages: {e}", "messages") from e


def chat_logprobs(tokenizer, logprobs: list[dict]) -> dict:
    """OpenAI's chat logprobs: {"content": [{"token", "logprob", "top_logprobs": [{"token", "logprob"}]}]}."""
    out = []
    for e in logprobs:
        out.append({"token": e.get("text", ""), "logprob": e["token_logprob"],
                    "top_logprobs": [{"token": tokenizer.decode([int(t)]), "logprob": v} for t, v in e["top"].items()]})
    return {"content": out}


async def chat(service, body: ChatRequest, http: HttpRequest):
    """Answer one chat call (a JSON reply, or an SSE stream with `stream`)."""
    engine, tok = service.engine, service.engine.tokenizer
    service.check_model(body.model)
    if (bad := body.unsupported()) is not None:
        raise ApiError(400, bad[1], bad[0])
    ids = chat_ids(body, tok)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, engine.plan.kv.max_seq_len - len(ids))
    top = (body.top_logprobs or 0) if body.logprobs else None
    call = Call(engine, body.model, "chatcmpl")
    call.submit([ids], body.n, lambda j: body.params(max_tokens, top, False, j))
    base = {"id": call.id, "object": "chat.completion.chunk" if body.stream else "chat.completion",
            "created": call.created, "model": body.model}
    if body.stream:
        started = set()

        def chunks(c: Choice, event: TokenEvent) -> list[dict]:
            out = []
            if c.index not in started:
                started.add(c.index)
                out.append({**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            lp = chat_logprobs(tok, _texts(tok, event)) if top is not None and event.logprobs else None
            delta = {"content": event.text} if event.text or event.finish_reason is None else {}
            out.append({**base, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                             "finish_reason": event.finish_reason}]})
            return out

        usage = base | {"choices": []} if body.stream_options and body.stream_options.include_usage else None
        return StreamingResponse(stream_body(call, chunks, usage), media_type="text/event-stream")
    if not await collect(call, http):
        return JSONResponse({}, status_code=499)
    call.check_failed()
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(tok, _texts(tok, c)) if top is not None else None,
                "finish_reason": c.finish_reason} for c in call.choices]
    return JSONResponse({**base, "choices": choices, "usage": call.usage()})


def _texts(tokenizer, item) -> list[dict]:
    """The logprob records of an event or a choice, each with its token's text."""
    ids = item.token_ids
    return [{**e, "text": tokenizer.decode([t])} for t, e in zip(ids, item.logprobs or [])]
