"""Run the app on uvicorn: bind first (a port in use is one line), load the engine behind /health, drain on SIGTERM.

Order of events:
1. bind host:port ourselves, so a port in use is refused before any rank starts;
2. start uvicorn on that socket and load the engine in a thread: /health answers 503 "loading" until
   every rank has loaded, then 200; a load that fails is reported and the server stops (exit 1);
3. on SIGTERM or Ctrl-C: the engine stops admitting (new requests get 503), uvicorn stops accepting
   connections and waits up to `drain_s` for the requests in flight to finish, then the ranks stop
   and the command exits 0.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
import time

import uvicorn

from shardlm.engine import chat_template
from shardlm.serve.app import Service, create_app

log = logging.getLogger(__name__)


class ServeError(RuntimeError):
    """The server cannot start as asked (a port in use, an address that cannot be bound)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; ServeError naming the problem and the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Protocol named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on accepted sockets whose proto is TCP,
    # and a socket made with proto 0 passes 0 on to what it accepts. With Nagle on, the second part of each reply
    # (uvicorn writes headers, then body) waited for the client's delayed ACK: ~40 ms a request on a kept-alive
    # connection, measured with httpx, which the openai client uses.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"port {port} on {host} is in use; stop what listens there or choose another --port") from e
        raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}); check --host and --port") from e
    return sock


def serve(service: Service, sock: socket.socket, drain_s: float = 30.0) -> int:
    """Serve until SIGTERM / Ctrl-C (exit status 0) or a failed load (1); the ranks are stopped either way."""
    service.start_metrics()
    config = uvicorn.Config(create_app(service), log_level="warning", timeout_graceful_shutdown=int(drain_s),
                            access_log=False)
    server = uvicorn.Server(config)
    service.engine.spawn()  # on this (main) thread: the ranks die with the thread that started them
    loader = threading.Thread(target=_load, args=(service, server), name="shardlm-load", daemon=True)
    loader.start()
    original = server.handle_exit

    def handle_exit(sig, frame):  # stop admitting at once: new requests get 503 while the rest drain
        if service.ready.is_set():
            service.engine.stop_admitting()
        original(sig, frame)

    server.handle_exit = handle_exit
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises the signal it caught once it has stopped;
        signal.signal(sig, _after_shutdown)       # this handler takes it, so a drained server exits 0
    try:
        server.run(sockets=[sock])
    finally:
        loader.join(timeout=1)
        if service.poller is not None:
            service.poller.stop()
        service.engine.close(drain_s=0, force=service.loading_error is not None)
    return 1 if service.loading_error is not None else 0


def _after_shutdown(sig, frame) -> None:
    """The signal that stopped the server, raised again by uvicorn after the drain: nothing left to do."""


def _load(service: Service, server: uvicorn.Server) -> None:
    """Wait for the ranks, then watch the engine: a failed load or a failed rank ends the server (exit 1)
    after a moment in which requests in flight receive their error."""
    try:
        service.engine.wait_ready()
        if service.poller is not None and service.metrics_interval_s:
            service.poller.start()
        service.ready.set()
        log.warning("ready: serving %s", service.model_name)
        template = getattr(service.engine.tokenizer, "chat_template", None)
        if template and (why := chat_template.problem(template)) is not None:
            log.warning("chat completions will answer 500: %s", why)
    except Exception as e:  # noqa: BLE001 - a failed load ends the server with its reason
        service.loading_error = getattr(e, "summary", None) or str(e)
        log.error("loading failed: %s", service.loading_error)
        server.should_exit = True
        return
    while not server.should_exit:
        if service.engine.failure is not None:
            service.loading_error = f"the engine stopped: {service.engine.failure.summary}"
            time.sleep(1.0)  # let the streams in flight carry the error to their clients
            server.should_exit = True
            return
        time.sleep(0.2)
