"""The transport side of the engine client and its stream: each attempt's deadlines, the answer a request
returns, and how an engine's error answer or a transport failure becomes an `EngineError`.

Owns `EngineAnswer` (a whole answer as read: status, headers, the capped bytes, the URL), the reading of a
server's error body (SGLang's, FastAPI's, plain text) and the classification of httpx and aiohttp failures.
Invariants: every attempt has a connect and a read deadline; every exception in `TRANSPORT_ERRORS` maps to
`EngineTimeout` or `EngineUnreachable`. The error classes live in `errors.py`, which imports no HTTP library.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from http import HTTPStatus
from typing import Protocol

import aiohttp
import httpx

from coordinator.engines.errors import EngineError, EngineHTTPError, EngineTimeout, EngineUnreachable
from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import decode_json

#: seconds to send a request body
WRITE_TIMEOUT = 30.0

#: what a request may raise below the HTTP status: each maps to one EngineError (`map_transport_error`)
TRANSPORT_ERRORS = (httpx.TransportError, aiohttp.ClientError, TimeoutError, ConnectionError)


class ErrorAnswer(Protocol):
    """What the error readers use of an answer: an `EngineAnswer`, or a streamed `httpx.Response`."""

    @property
    def status_code(self) -> int: ...

    @property
    def content(self) -> bytes: ...

    @property
    def text(self) -> str: ...

    @property
    def reason_phrase(self) -> str: ...


class EngineAnswer:
    """One whole answer as the engine client read it (its body under the request's byte cap): no HTTP library's
    response model is built for it, so a request costs the socket work and little more."""

    __slots__ = ("content", "headers", "status_code", "url")

    def __init__(self, status_code: int, headers: Mapping[str, str], content: bytes, url: str) -> None:
        self.status_code = status_code
        #: case-insensitive (aiohttp's `CIMultiDictProxy`), the headers as received: a compressed answer's
        #: content-length and content-encoding describe the wire's bytes, not `content` (decoded)
        self.headers = headers
        self.content = content
        self.url = url

    def __repr__(self) -> str:
        return f"<EngineAnswer [{self.status_code}] {self.url}>"

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    @property
    def reason_phrase(self) -> str:
        try:
            return HTTPStatus(self.status_code).phrase
        except ValueError:
            return ""


def _decoded(resp: ErrorAnswer) -> object:
    """The error answer's JSON (bounded: a hostile error body cannot recurse), or `_NOT_JSON`."""
    try:
        return decode_json(resp.content, "engine error answer")
    except BoundaryError:
        return _NOT_JSON


_NOT_JSON = object()


def server_error_type(resp: ErrorAnswer) -> str | None:
    """`error.type` of a `{"error": {"type": ...}}` body, else None."""
    body = _decoded(resp)
    error = body.get("error") if isinstance(body, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else None


def server_message(resp: ErrorAnswer) -> str:
    """The server's error text: SGLang's `{"error": {"message"}}`, `{"error": str}`, FastAPI `detail`, text."""
    text = resp.text
    body = _decoded(resp)
    if body is _NOT_JSON:
        return text.strip() or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return json.dumps(body["detail"]) if not isinstance(body["detail"], str) else body["detail"]
    return text.strip()


def error_from_response(resp: ErrorAnswer, url: str) -> EngineHTTPError:
    """The typed error of an answer with an error status, carrying the server's own message and type."""
    return EngineHTTPError(resp.status_code, server_message(resp), url, server_error_type(resp))


def map_transport_error(exc: BaseException, url: str, timeout: float | None) -> EngineError:
    """Classify a transport failure. AiohttpTransport maps aiohttp errors loosely (a server disconnect
    becomes httpx.ConnectTimeout), so the original aiohttp exception in `__cause__` decides when present."""
    cause = exc.__cause__ if isinstance(exc, httpx.HTTPError) and exc.__cause__ is not None else exc
    if isinstance(cause, aiohttp.ClientError | TimeoutError):
        if isinstance(cause, aiohttp.ServerTimeoutError | TimeoutError):
            return EngineTimeout(url, timeout, cause)
        return EngineUnreachable(url, cause)
    if isinstance(exc, httpx.TimeoutException):
        return EngineTimeout(url, timeout, exc)
    return EngineUnreachable(url, exc)


def request_timeout(connect: float, read: float | None) -> httpx.Timeout:
    """One attempt's deadlines. pool=None: waiting for a free socket is bounded by the caller's concurrency
    (the pool is sized to it), not by a timeout."""
    return httpx.Timeout(connect=connect, read=read, write=WRITE_TIMEOUT, pool=None)


@functools.lru_cache(maxsize=64)  # once per request on the generate path; ClientTimeout is frozen, its values few
def aiohttp_timeout(connect: float, read: float | None) -> aiohttp.ClientTimeout:
    """The same deadlines for a request sent on the aiohttp session itself (as `AiohttpTransport` maps them:
    aiohttp has no write deadline; a body the size of a request is written at once or the connection fails)."""
    return aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect, sock_read=read)
