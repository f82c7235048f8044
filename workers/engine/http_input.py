"""Reading requests safely: the API key, size, JSON shape and nesting bounds, and clients that go away mid-body.

Owns `read_json` (every JSON endpoint of the server reads its body through it), `BodyLimitMiddleware` and
`ApiKeyMiddleware` (the gates a request passes before the app reads it).

Invariants:
- no body larger than the engine's `--max-request-bytes` is read into memory: a declared Content-Length over
  it is a 413 before the app runs; a chunked body is cut off when it passes the limit (a 400);
- JSON nested deeper than `MAX_JSON_DEPTH`, or holding NaN/Infinity (not JSON; SGLang's orjson refuses them
  too), is a 400 — never a RecursionError 500;
- a large body is parsed off the event loop, so a 60 MB request does not stall /health for everyone else;
- a client that disconnects before its body is complete costs one log line, not a traceback.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from workers.engine.sampling_params import RequestError, show

log = logging.getLogger("rayless.engine.http")

MAX_JSON_DEPTH = 32  # SGLang's bodies need 4 (custom_params objects); 32 leaves room and bounds recursion
PARSE_IN_THREAD_BYTES = 1 << 20

class ClientGone(RequestError):
    """The client disconnected before its body was complete; the answer goes nowhere."""


class ApiKeyMiddleware:
    """Bearer auth on every path except /health* and /metrics (as SGLang's --api-key)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if not (path.startswith("/health") or path == "/metrics"):
                header = dict(scope["headers"]).get(b"authorization", b"")
                if not secrets.compare_digest(header, self.expected):
                    await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for any request whose declared Content-Length is over `max_bytes`, before the app reads it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                response = JSONResponse(
                    {"error": {"message": f"request body of {int(declared)} bytes is over the engine's "
                               f"--max-request-bytes ({self.max_bytes})"}},
                    status_code=413,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _reject_constant(name: str) -> Any:
    raise RequestError(f"request body is not valid JSON: {name} is not a JSON number")


def _check_depth(value: Any) -> None:
    """Iteratively (no recursion) refuse containers nested deeper than MAX_JSON_DEPTH."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, (list, dict)):
                stack.append((child, depth + 1))


def parse_json(body: bytes) -> Any:
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise RequestError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        if isinstance(exc, RequestError):
            raise
        raise RequestError(f"request body is not valid JSON: {show(str(exc))}") from None
    if isinstance(value, (list, dict)):
        _check_depth(value)
    return value


async def read_body(request: Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise RequestError(f"request body is over the engine's --max-request-bytes ({max_bytes})")
            chunks.append(chunk)
    except ClientDisconnect:
        client = f"{request.client.host}:{request.client.port}" if request.client else "?"
        log.info("client %s disconnected before sending the whole body of %s %s (%d bytes read)",
                 client, request.method, request.url.path, size)
        raise ClientGone("client disconnected") from None
    return b"".join(chunks)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object ({} when empty); RequestError (400) otherwise."""
    body = await read_body(request, max_bytes)
    if not body.strip():
        return {}
    if len(body) > PARSE_IN_THREAD_BYTES:
        value = await anyio.to_thread.run_sync(parse_json, body)
    else:
        value = parse_json(body)
    if not isinstance(value, dict):
        raise RequestError("request body must be a JSON object")
    return value
