"""The gates every request to a rayless server passes, as ASGI middleware, and its error shape.

Owns `error_response` (SGLang's `{"error": {"message": ...}}`) and `HttpReply` (a route's way to answer
with it), `ApiKeyMiddleware` (Bearer auth on every path but the health and metrics ones, compared in constant
time; Anthropic's `x-api-key` taken on its Messages paths), `MethodGate` (CONNECT refused with a 405 before any app sees it), `AdminKeyMiddleware` (SGLang's separate
key for control routes), `BodyLimitMiddleware` (413 on a declared length over the limit before the app runs) and
`read_body` / `read_json` (a streamed body cut off at the limit, then
decoded through `json_input`, off the event loop when large). Shared by the engine, the hook endpoint and the
session server.

Invariant: no body over its limit is held in memory, no JSON is decoded but through `decode_json_async`, and
every refusal is one JSON reply (or `BoundaryError` for the route to turn into one), never a traceback.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import JsonLimits, decode_json_async

log = logging.getLogger("rayless.http")

UNAUTHORIZED = {"error": "Unauthorized"}  # SGLang's own 401 body


def error_response(message: str, status: int = 400) -> JSONResponse:
    """The one error shape of every rayless server (SGLang's)."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


class HttpReply(Exception):
    """Answer the current request with this status and message (a route raises it; `reply_handler` answers)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def reply_handler(_request: Request, exc: Exception) -> JSONResponse:
    """Starlette exception handler: an `HttpReply` (or Starlette's own 404/405) in the error shape."""
    status = getattr(exc, "status", None) or getattr(exc, "status_code", 500)
    return error_response(str(exc) if isinstance(exc, HttpReply) else str(getattr(exc, "detail", exc)), status)


def open_path(path: str) -> bool:
    """Paths answered without the API key, as SGLang: health probes and metrics."""
    return path.startswith("/health") or path == "/metrics"


#: the paths of Anthropic's Messages API, on an engine or under a session's prefix: the `anthropic` SDK sends its
#: `api_key` as `x-api-key` (its `auth_token` as a Bearer token), so either opens them
ANTHROPIC_PATH_ENDS = ("/v1/messages", "/v1/messages/count_tokens")


def key_presented(scope: Scope, expected: bytes) -> bool:
    """Whether the request carries the key `expected` (`Bearer KEY`) as `Authorization`, or, on an Anthropic
    Messages path, as `x-api-key` (the Anthropic SDK's own header), compared in constant time."""
    headers = dict(scope["headers"])
    if secrets.compare_digest(headers.get(b"authorization", b""), expected):
        return True
    anthropic_key = headers.get(b"x-api-key")
    return (anthropic_key is not None and scope["path"].endswith(ANTHROPIC_PATH_ENDS)
            and secrets.compare_digest(b"Bearer " + anthropic_key, expected))


class ClientGone(BoundaryError):
    """The client disconnected before its body was complete; the answer goes nowhere."""


class BodyTooLarge(BoundaryError):
    """A streamed body passed its limit (a declared one is refused before: `BodyLimitMiddleware`)."""


class ApiKeyMiddleware:
    """Bearer auth on every path `exempt` does not open (default: /health* and /metrics, as SGLang); on an
    Anthropic Messages path the key may come as `x-api-key` too (`key_presented`)."""

    def __init__(self, app: ASGIApp, api_key: str, *, body: Any = UNAUTHORIZED,
                 exempt: Callable[[str], bool] = open_path) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.body = body
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.exempt(scope["path"]):
            if not key_presented(scope, self.expected):
                await JSONResponse(self.body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class MethodGate:
    """A 405 for CONNECT, before any app: answered 2xx, h11 would switch the connection to a tunnel and the app's
    next write would raise inside uvicorn (a traceback in the log for one request line). Every rayless server
    serves plain requests only."""

    REFUSED = frozenset({"CONNECT"})

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") in self.REFUSED:
            response = error_response(f"method {scope['method']} is not served here", 405)
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class AdminKeyMiddleware:
    """SGLang's two keys (`--api-key`, `--admin-api-key`): a path `is_admin` names is asked for the admin key when
    one is set — the API key does not open it then — else for the API key; every other path but the open ones is
    asked for the API key when one is set. 401 `{"error": "Unauthorized"}` otherwise, as SGLang."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, admin_api_key: str | None,
                 is_admin: Callable[[str], bool], exempt: Callable[[str], bool] = open_path) -> None:
        self.app = app
        self.normal = f"Bearer {api_key}".encode() if api_key else None
        self.admin = f"Bearer {admin_api_key}".encode() if admin_api_key else self.normal
        self.is_admin = is_admin
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.exempt(scope["path"]):
            expected = self.admin if self.is_admin(scope["path"]) else self.normal
            if expected is not None and not key_presented(scope, expected):
                await JSONResponse(UNAUTHORIZED, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for any request whose declared Content-Length is over `max_bytes`, before the app reads it."""

    def __init__(self, app: ASGIApp, max_bytes: int, *, limit_name: str = "the limit") -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.limit_name = limit_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                message = f"request body of {int(declared)} bytes is over {self.limit_name} ({self.max_bytes})"
                await error_response(message, 413)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_body(request: Request, max_bytes: int, *, limit_name: str = "the limit") -> bytes:
    """The whole body, refused (`BoundaryError`) as soon as it passes `max_bytes`."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge("request body", f"over {limit_name} ({max_bytes})")
            chunks.append(chunk)
    except ClientDisconnect:
        client = f"{request.client.host}:{request.client.port}" if request.client else "?"
        log.info("client %s disconnected before sending the whole body of %s %s (%d bytes read)",
                 client, request.method, request.url.path, size)
        raise ClientGone("request body", "client disconnected") from None
    return b"".join(chunks)


async def read_json(request: Request, max_bytes: int, *, limits: JsonLimits | None = None,
                    limit_name: str = "the limit") -> dict[str, Any]:
    """The body as a JSON object ({} when empty) within `limits`; `BoundaryError` otherwise."""
    body = await read_body(request, max_bytes, limit_name=limit_name)
    if not body.strip():
        return {}
    value = await decode_json_async(body, "request body", limits or JsonLimits(max_bytes=max(max_bytes, 1)))
    if not isinstance(value, dict):
        raise BoundaryError("request body", f"must be a JSON object, not {type(value).__name__}")
    return value
