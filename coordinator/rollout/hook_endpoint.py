"""The address hooks post to when no router is used: a small HTTP server in the coordinator whose `/generate`
goes through the rollout's dispatcher.

Owns `HookEndpoint`: a listener on 127.0.0.1 (port chosen by the OS unless given), HTTP/1.1 with keep-alive
(h11 over anyio streams), two routes — `POST /generate` (the body forwarded to an engine exactly as the
default generate path sends its requests: least-in-flight, the prompt group kept on one engine, retried on
another when its engine dies; engines paused for a weight update hold it until they resume) and
`GET /health` — and nothing else; each answer names the engine that served it (`X-Rayless-Engine`). A request
carrying a hook call's route (`X-Rayless-Route`, set by `post`)
goes to its group's engine (picked again if that engine died) and, when its sampling params name no seed,
gets a deterministic one from (the rollout seed, rollout, group, sample, context length), as our own requests.

Invariants: bounded — at most `max_connections` connections (the next waits in the accept queue), a request
head of at most 16 KiB and a body of at most `max_body_bytes` (else 413), a deadline on reading each request;
with `--sglang-api-key` every request must carry it as `Authorization: Bearer` (else 401), as SGLang asks; every
failure is a JSON `{"error": {"message"}}` with the status a client can act on (4xx from the engine passed
through, 502 for an engine failure, 503 when no engine is alive), never a traceback.
"""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

import anyio
import anyio.abc
import h11

from coordinator.engines.errors import EngineError, EngineHTTPError
from coordinator.hooks.runtime import ROUTE_HEADER, HookRoutes
from coordinator.rollout.dispatch import Dispatcher, NoEngineAvailable
from coordinator.rollout.requests import seed_for

ENGINE_HEADER = "X-Rayless-Engine"

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
#: Seconds a client may take to send a whole request (from its first byte), and to idle between requests.
REQUEST_DEADLINE_S = 60.0
IDLE_DEADLINE_S = 600.0


class HttpReply(Exception):
    """Answer the current request with this status and message, then go on (or close when `close`)."""

    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.close = close


def _json(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _error_body(message: str) -> bytes:
    return _json({"error": {"message": message}})


class HookEndpoint:
    """The coordinator's `/generate` for hooks; `await task_group.start(endpoint.run)` returns once it listens.

    Args:
        dispatcher: the rollout's dispatcher (its engines, its retry on engine death).
        routes: the hook calls in flight (`HookRuntime.routes`).
        seed: the rollout seed (`--rollout-seed`) for the requests' seeds.
        api_key: required from clients when set (`--sglang-api-key`).
    """

    DESCRIPTION = "hook endpoint (POST /generate through the rollout's dispatcher)"

    def __init__(self, *, dispatcher: Dispatcher, routes: HookRoutes, seed: int, api_key: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_connections: int = 1024,
                 max_body_bytes: int = 64 * 1024 * 1024) -> None:
        self.dispatcher = dispatcher
        self.routes = routes
        self.seed = seed
        self.api_key = api_key
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.max_body_bytes = max_body_bytes
        self.requests = 0
        self.connections = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def run(self, *, task_status: anyio.abc.TaskStatus[HookEndpoint] = anyio.TASK_STATUS_IGNORED) -> None:
        multi = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        (listener,) = multi.listeners
        async with listener, anyio.create_task_group() as group:
            self.port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
            log.info("%s listening on %s", self.DESCRIPTION, self.url)
            task_status.started(self)
            free = anyio.Semaphore(self.max_connections)
            while True:
                await free.acquire()
                try:
                    stream = await listener.accept()
                except BaseException:
                    free.release()
                    raise
                group.start_soon(self._serve_connection, stream, free)

    # --- one connection --------------------------------------------------------------------------------------
    async def _serve_connection(self, stream: anyio.abc.SocketStream, free: anyio.Semaphore) -> None:
        self.connections += 1
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        try:
            async with stream:
                while await self._serve_one(connection, stream):
                    connection.start_next_cycle()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, ConnectionError,
                TimeoutError, h11.ProtocolError) as error:
            log.debug("hook endpoint: connection ended: %s", error)
        finally:
            self.connections -= 1
            free.release()

    async def _serve_one(self, connection: h11.Connection, stream: anyio.abc.SocketStream) -> bool:
        """Read one request and answer it; False when the connection is to close."""
        try:
            with anyio.fail_after(IDLE_DEADLINE_S):
                event = await self._next_event(connection, stream)
            if isinstance(event, h11.ConnectionClosed):
                return False
            if not isinstance(event, h11.Request):
                raise HttpReply(400, "expected an HTTP request", close=True)
            with anyio.fail_after(REQUEST_DEADLINE_S):
                body = await self._read_body(connection, stream, event)
            status, data, served_by = await self._respond(event, body)
        except HttpReply as reply:
            status, data, served_by = reply.status, _error_body(str(reply)), None
            if reply.close or connection.their_state not in (h11.DONE, h11.MUST_CLOSE):
                await self._send(connection, stream, status, data, close=True)
                return False
        except h11.RemoteProtocolError as error:
            if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await self._send(connection, stream, error.error_status_hint, _error_body(str(error)), close=True)
            return False
        extra = [(ENGINE_HEADER.lower(), served_by)] if served_by else []
        await self._send(connection, stream, status, data, extra=extra)
        return connection.our_state is h11.DONE and connection.their_state is h11.DONE

    async def _next_event(self, connection: h11.Connection, stream: anyio.abc.SocketStream) -> Any:
        while True:
            event = connection.next_event()
            if event is not h11.NEED_DATA:
                return event
            if connection.they_are_waiting_for_100_continue:
                await stream.send(connection.send(h11.InformationalResponse(status_code=100, headers=[])))
            try:
                data = await stream.receive(65536)
            except anyio.EndOfStream:
                data = b""
            connection.receive_data(data)

    async def _read_body(self, connection: h11.Connection, stream: anyio.abc.SocketStream,
                         request: h11.Request) -> bytes:
        length = next((value for name, value in request.headers if name == b"content-length"), None)
        if length is not None and int(length) > self.max_body_bytes:
            raise HttpReply(413, f"request body of {int(length)} bytes is over the limit of {self.max_body_bytes}",
                         close=True)
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await self._next_event(connection, stream)
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.max_body_bytes:
                    raise HttpReply(413, f"request body over the limit of {self.max_body_bytes} bytes", close=True)
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                raise HttpReply(400, "the request ended before its body", close=True)

    async def _send(self, connection: h11.Connection, stream: anyio.abc.SocketStream, status: int, data: bytes,
                    *, close: bool = False, extra: list[tuple[str, str]] | None = None) -> None:
        extra = list(extra or [])
        kind = next((value for name, value in extra if name == "content-type"), "application/json")
        extra = [(name, value) for name, value in extra if name != "content-type"]
        headers = [("content-type", kind), ("content-length", str(len(data))), *extra]
        if close:
            headers.append(("connection", "close"))
        await stream.send(connection.send(h11.Response(status_code=status, headers=headers)))
        await stream.send(connection.send(h11.Data(data=data)))
        await stream.send(connection.send(h11.EndOfMessage()))

    # --- routes ----------------------------------------------------------------------------------------------
    async def _respond(self, request: h11.Request, body: bytes) -> tuple[int, bytes, str | None]:
        self.requests += 1
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in request.headers}
        self._authorise(headers)
        path = request.target.decode("latin-1").split("?", 1)[0]
        method = request.method.decode("latin-1")
        if path == "/health":
            return 200, b"{}", None
        if path != "/generate":
            raise HttpReply(404, f"{path}: this endpoint serves POST /generate (and GET /health) for hooks")
        if method != "POST":
            raise HttpReply(405, f"{method} {path}: use POST")
        try:
            payload = json.loads(body)
        except ValueError as error:
            raise HttpReply(400, f"the body is not JSON: {error}") from None
        if not isinstance(payload, dict):
            raise HttpReply(400, f"the body must be a JSON object (SGLang's /generate request), got "
                              f"{type(payload).__name__}")
        response, url = await self._generate(payload, headers.get(ROUTE_HEADER.lower()))
        return 200, _json(response), url

    def _authorise(self, headers: dict[str, str]) -> None:
        if not self.api_key:
            return
        given = headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise HttpReply(401, "missing or wrong API key (Authorization: Bearer, as --sglang-api-key)")

    async def _generate(self, payload: dict[str, Any], token: str | None) -> tuple[Any, str]:
        route = self.routes.get(token)
        engine = None
        if route is not None and self.dispatcher.router_url is None:
            group = route.group
            if group.engine is None or not getattr(group.engine, "alive", True):
                group.engine = await self.dispatcher.pick()
            engine = group.engine
            params = payload.get("sampling_params")
            if isinstance(params, dict) and "sampling_seed" not in params:
                progress = len(payload.get("input_ids") or payload.get("text") or ())
                payload["sampling_params"] = {**params, "sampling_seed": seed_for(
                    self.seed, group.rollout_id, group.group_index, route.sample_index, progress)}
        try:
            response, url = await self.dispatcher.generate(payload, engine=engine)
            if route is not None and engine is not None and url != engine.url:
                # Its engine died and another answered: the group sticks to that one from now on.
                pool = self.dispatcher.pool
                route.group.engine = next((h for h in (pool.alive() if pool else ()) if h.url == url), None)
            return response, url
        except EngineHTTPError as error:
            raise HttpReply(error.status if 400 <= error.status < 500 else 502, error.server_message) from None
        except NoEngineAvailable as error:
            raise HttpReply(503, str(error)) from None
        except EngineError as error:
            raise HttpReply(502, str(error)) from None
