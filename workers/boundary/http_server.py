"""Serving an ASGI app the one way every rayless server is served: on a socket bound first, under a
`ConnectionGuard`, by uvicorn's h11 protocol.

Owns `bind`, `HttpService` (an app served inside the caller's anyio task group: `await tg.start(service.run)`
returns once the socket is bound and listening, and the server stops when the task is cancelled), `AppServer`
(the base of the coordinator's servers, on `HttpService`) and
`serve_process` (an app that is the whole process, the engine: uvicorn's signal handling kept).

Invariants: the port is bound (and listening) before anyone is told it is; the process's soft limit of open
files is raised to its hard limit and the connection cap kept below it, so accepting never fails with EMFILE
(asyncio would stop accepting for a second, /health included); uvicorn never reconfigures the caller's logging;
no request line reaches an app in a form h11 cannot answer (CONNECT: `MethodGate`), so none writes a traceback,
and a request cancelled because its server stops is not logged as an error either.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import anyio.abc
import uvicorn
from starlette.types import ASGIApp

from workers.boundary.http_gates import MethodGate
from workers.boundary.http_guard import ConnectionGuard, ServerLimits, guarded_protocol

log = logging.getLogger("rayless.http")

BACKLOG = 4096  # the kernel caps it at somaxconn; a flood waits there rather than being reset
FDS_KEPT_FREE = 256  # for everything else the process opens (engines' clients, logs, pipes)


def raise_open_files_limit() -> int:
    """Raise the soft limit of open files to the hard one; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def capped(limits: ServerLimits) -> ServerLimits:
    """`limits` with the connection cap below what the process may open."""
    room = max(raise_open_files_limit() - FDS_KEPT_FREE, 16)
    if limits.max_connections > room:
        log.info("connection cap lowered from %d to %d (open-files limit)", limits.max_connections, room)
        return replace(limits, max_connections=room)
    return limits


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: one the OS picks); OSError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as error:
        sock.close()
        raise OSError(error.errno, f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.setblocking(False)
    return sock


class RequestCancelledAtStop(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" for a request whose task was cancelled: a server stopping
    cancels the requests in flight (`_stop`), which is not an error and has no traceback worth showing."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, asyncio.CancelledError)


def _quiet_cancelled_requests() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(existing, RequestCancelledAtStop) for existing in logger.filters):
        logger.addFilter(RequestCancelledAtStop())


def uvicorn_config(app: ASGIApp, limits: ServerLimits, guard: ConnectionGuard, *, log_level: str = "warning",
                   lifespan: str = "off", log_config: Any = None, access_log: bool = False,
                   graceful_s: float = 5.0) -> uvicorn.Config:
    _quiet_cancelled_requests()
    return uvicorn.Config(
        MethodGate(app), http=guarded_protocol(guard), lifespan=lifespan, log_level=log_level, log_config=log_config,
        access_log=access_log, backlog=BACKLOG, timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
        # h11's own head limit stays above ours, so ours (431) speaks first
        h11_max_incomplete_event_size=4 * limits.max_head_bytes, timeout_graceful_shutdown=int(graceful_s),
        ws="none",
    )


@dataclass
class HttpService:
    """`app` served on host:port inside an anyio task group (the hook endpoint, the session server...)."""

    app: ASGIApp
    host: str = "127.0.0.1"
    port: int = 0
    limits: ServerLimits = field(default_factory=ServerLimits)
    description: str = "HTTP server"
    guard: ConnectionGuard | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def run(self, *, task_status: anyio.abc.TaskStatus[HttpService] = anyio.TASK_STATUS_IGNORED) -> None:
        limits = capped(self.limits)
        self.guard = ConnectionGuard(limits)
        sock = bind(self.host, self.port)
        self.port = int(sock.getsockname()[1])
        config = uvicorn_config(self.app, limits, self.guard)
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)  # what `Server.serve` sets up before `startup`
        try:
            await server.startup(sockets=[sock])
            log.info("%s listening on %s", self.description, self.url)
            task_status.started(self)
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(10.0):
                await _stop(server, self.guard)
            sock.close()


async def _stop(server: uvicorn.Server, guard: ConnectionGuard) -> None:
    """Stop at once (the run is ending): no new connection, every open one dropped, its request cancelled."""
    for listening in getattr(server, "servers", []):
        listening.close()
    for connection in list(guard.live):
        connection.transport.abort()
    tasks = list(server.server_state.tasks)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=5.0)

class AppServer:
    """Base of an in-process server that owns routes: `app()` builds them, `run` serves them on `HttpService`
    and starts the caller's task with the server itself (its port known)."""

    DESCRIPTION = "HTTP server"

    def __init__(self, *, host: str, port: int, limits: ServerLimits) -> None:
        self.host = host
        self.port = port
        self.limits = limits
        #: the service once `run` started it (its `guard` tells what the connections are doing)
        self.service: HttpService | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> ASGIApp:
        raise NotImplementedError

    async def run(self, *, task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED) -> None:
        service = self.service = HttpService(app=self.app(), host=self.host, port=self.port, limits=self.limits,
                                             description=self.DESCRIPTION)
        async with anyio.create_task_group() as group:
            await group.start(service.run)  # the socket is bound and listening from here on
            self.port = service.port
            task_status.started(self)


def serve_process(app: ASGIApp, host: str, port: int, *, limits: ServerLimits | None = None,
                  log_level: str = "info", access_log: bool = False, lifespan: str = "on",
                  graceful_s: float = 5.0) -> None:
    """Serve `app` as the whole process until SIGINT/SIGTERM (uvicorn's handlers, then its graceful stop)."""
    limits = capped(limits or ServerLimits())
    sock = bind(host, port)
    config = uvicorn_config(app, limits, ConnectionGuard(limits), log_level=log_level, lifespan=lifespan,
                            log_config=uvicorn.config.LOGGING_CONFIG, access_log=access_log, graceful_s=graceful_s)
    anyio.run(uvicorn.Server(config).serve, [sock])
