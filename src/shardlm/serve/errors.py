"""Errors in OpenAI's JSON shape with the right HTTP status, from engine exceptions and bad requests.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": 400}}

400 a bad parameter (named, with its accepted range), 401 a wrong or missing API key, 404 an unknown
model, 429 the queue is full, 500 a failed rank (named), 503 the engine is loading or shutting down.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from shardlm.engine.requests import RequestError
from shardlm.engine.service import EngineClosed, QueueFull

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}

UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")


class ApiError(Exception):
    """An error reply: HTTP status, message, and the parameter it is about (if any)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        """The reply."""
        return error_response(self.status, self.message, self.param)


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error reply."""
    kind = TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status)


def submit_error(e: Exception) -> ApiError:
    """The reply for an exception raised while submitting a request to the engine."""
    if isinstance(e, RequestError):
        return ApiError(400, str(e), e.param)
    if isinstance(e, QueueFull):
        return ApiError(429, str(e))
    if isinstance(e, EngineClosed):
        return ApiError(503, f"the engine is not serving: {e}")
    return ApiError(500, f"{type(e).__name__}: {e}")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, parameter) for pydantic's first validation error of a request body: the first one a validator
    raised, where a union's other branches only say that the value has another type."""
    err = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    # a union's branch shows up in the path ("stop", "str"): keep field names and list indexes only
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not UNION_BRANCH.match(str(x))]
    param = ".".join(loc) or None
    got = err.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{param or 'the request body'}: {err.get('msg', 'invalid')} (got {shown})", param
