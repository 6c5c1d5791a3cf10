"""The HTTP app (FastAPI): OpenAI-compatible completions and chat, models, health and version.

    GET  /v1/models             the served model
    POST /v1/completions        prompt text, texts, token ids or lists of them; stream; logprobs; echo
    POST /v1/chat/completions   messages through the model's chat template; stream
    GET  /health                200 once every rank has loaded; 503 with the reason otherwise
    GET  /version               shardlm's version
    GET  /stats                 requests running and waiting, KV-cache slots, steps, finished by reason
    GET  /metrics               Prometheus text: requests, KV cache, memory per rank by kind, traffic per link,
                                step time per stage, each beside the plan's prediction (serve/metrics.py)
    GET  /dashboard             one page drawing /metrics live (serve/dashboard.html; no build, no network)

With an API key, /v1/* wants `Authorization: Bearer KEY` (401 otherwise); health and version stay
open for probes. Errors are OpenAI's JSON (serve/errors.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException

import shardlm
from shardlm.serve.chat import chat
from shardlm.serve.completions import complete
from shardlm.serve.errors import ApiError, error_response, validation_message
from shardlm.serve.schemas import ChatRequest, CompletionRequest

log = logging.getLogger(__name__)


@dataclass
class Service:
    """What the app serves: the engine (started in the background so /health answers while it loads)."""

    engine: object
    model_name: str
    api_key: str | None = None
    loading_error: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    metrics_interval_s: float = 5.0
    """How often the ranks' counters are gathered for /metrics (0: never; /metrics then has requests only)."""
    metrics: bool = True
    """False (--no-metrics): no request metrics, no rank polling, /metrics answers 404."""
    registry: object = None
    poller: object = None
    rank_text: object = None

    def start_metrics(self) -> None:
        """Register the request metrics with the engine and start polling the ranks (unless metrics are off)."""
        if not self.metrics:
            return
        from prometheus_client import CollectorRegistry

        from shardlm.serve.metrics import EngineCollector, RankExposition, RankPoller, RequestMetrics

        self.registry = CollectorRegistry()
        self.engine.scheduler.observer = RequestMetrics(self.registry, self.model_name)
        self.poller = RankPoller(self.engine, self.metrics_interval_s)  # started only when the interval is > 0
        self.registry.register(EngineCollector(self.engine, self.poller, self.model_name))
        self.rank_text = RankExposition(self.engine, self.poller)

    def metrics_text(self) -> bytes:
        """The exposition, with the ranks' counters as of the last poll (polled now if there was none)."""
        from prometheus_client import generate_latest

        if self.poller.latest is None and self.ready.is_set() and self.metrics_interval_s:
            self.poller.poll()
        return generate_latest(self.registry) + self.rank_text.text()

    def check_model(self, name: str) -> None:
        """ApiError 404 unless `name` is the served model."""
        if name != self.model_name:
            raise ApiError(404, f"model {name!r} is not served here; this server serves {self.model_name!r} "
                                "(GET /v1/models)", "model")

    def health(self) -> tuple[bool, str]:
        """(ready, reason)."""
        if self.loading_error is not None:
            return False, self.loading_error if self.ready.is_set() else f"loading failed: {self.loading_error}"
        if not self.ready.is_set():
            return False, "the ranks are loading the model"
        return self.engine.health()

    def usable(self) -> None:
        """ApiError 503 unless requests can be served now."""
        ok, reason = self.health()
        if not ok:
            raise ApiError(503, reason)


class KeyCheck:
    """ASGI middleware: a request to /v1/ without the server's API key gets 401; every other request passes
    through untouched. (FastAPI's @app.middleware("http") would pass each chunk of a streamed response through a
    memory stream and a task of its own, a cost on every token of every stream.)"""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send) -> None:
        key = self.service.api_key
        if key and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            sent = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if sent != f"Bearer {key}":
                response = error_response(401, "a wrong or missing API key: send the header "
                                               "'Authorization: Bearer KEY' with the server's --api-key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(service: Service) -> FastAPI:
    """The FastAPI app for `service`."""
    app = FastAPI(title="shardlm", version=shardlm.__version__, docs_url=None, redoc_url=None)
    app.state.service = service

    app.add_middleware(KeyCheck, service=service)
    _error_handlers(app)

    @app.get("/health")
    async def health():
        ok, reason = service.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "reason": reason}, status_code=200 if ok else 503)

    _monitoring_routes(app, service)

    @app.get("/version")
    async def version():
        return {"version": shardlm.__version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "owned_by": "shardlm",
                                            "max_model_len": service.engine.plan.kv.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service.usable()
        return await complete(service, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        service.usable()
        return await chat(service, body, request)

    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error reply in OpenAI's JSON shape: ours, pydantic's, and the framework's own (a body that is not
    UTF-8, an unknown route, a wrong method), which it would send as {"detail": ...}."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def _framework(request: Request, exc: HTTPException):
        where = f"{request.method} {request.url.path}"
        message = {400: f"the request body could not be read ({exc.detail}); send one JSON object encoded as UTF-8",
                   404: f"no route {where}; the API serves /v1/models, /v1/completions and /v1/chat/completions",
                   405: f"{where} is not allowed; see GET /v1/models, POST /v1/completions or /v1/chat/completions",
                   }.get(exc.status_code, f"{where}: {exc.detail}")
        return error_response(exc.status_code, message)


def _monitoring_routes(app: FastAPI, service: Service) -> None:
    """GET /stats, /metrics and /dashboard."""

    @app.get("/stats")
    async def stats():
        if not service.ready.is_set():
            return JSONResponse({"ready": False, "reason": service.health()[1]}, status_code=503)
        st = dataclasses.asdict(service.engine.stats())
        return {"ready": True, **st, "free_slots": st["slots"] - st["running"]}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        if not service.metrics:
            raise ApiError(404, "this server runs with --no-metrics; restart it without that flag for /metrics")
        loop = asyncio.get_running_loop()  # a first poll waits for a step boundary: not on the event loop
        return Response(await loop.run_in_executor(None, service.metrics_text), media_type=CONTENT_TYPE_LATEST)

    @app.get("/dashboard")
    async def dashboard():
        from importlib.resources import files

        return HTMLResponse(files("shardlm.serve").joinpath("dashboard.html").read_text(encoding="utf-8"))
