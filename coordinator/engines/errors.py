"""The engine client's typed errors, and how an engine's error answer or a transport failure maps to one.

Owns: the `EngineError` family and the reading of a server's error body (SGLang's, FastAPI's, plain text).
Invariant: callers of the engine client see only `EngineError` subclasses, never an httpx/aiohttp exception.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import httpx

from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import decode_json
from workers.errors import RaylessError

#: the error type our engine answers with while its memory is released (503)
MEMORY_RELEASED = "MemoryReleased"

#: what a request may raise below the HTTP status: each maps to one EngineError (`map_transport_error`)
TRANSPORT_ERRORS = (httpx.TransportError, aiohttp.ClientError, TimeoutError, ConnectionError)


class EngineError(RaylessError):
    """Base of every error the engine client raises."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.message = message
        self.url = url


class EngineHTTPError(EngineError):
    """The engine answered with an error status (4xx at once, 5xx after the retries ran out).

    `error_type`: the `type` of the server's `{"error": {...}}` body when it names one — our engine says
    "MemoryReleased" while its memory is released (`released`), so a caller can tell that from a failure."""

    def __init__(self, status: int, message: str, url: str, error_type: str | None = None) -> None:
        super().__init__(f"{url} answered HTTP {status}: {message}", url)
        self.status = status
        self.server_message = message
        self.error_type = error_type

    @property
    def released(self) -> bool:
        """The engine refused because its memory is released (`/release_memory_occupation`): alive, not dead."""
        return self.error_type == MEMORY_RELEASED


class EngineStreamError(EngineHTTPError):
    """A streamed generate reported `data: {"error": ...}` in the middle of an HTTP 200 stream."""


class EngineReplyError(EngineError, BoundaryError):
    """The peer answered 200 with a reply rayless refuses: over its size limit, not bounded JSON, or not the
    shape SGLang gives (float or out-of-vocabulary ids, a NaN logprob, ids and logprobs of different lengths).
    The dispatch treats it like a dead engine's failed request: retried on another engine, counted."""

    def __init__(self, url: str, reason: str) -> None:
        BoundaryError.__init__(self, f"engine {url}", reason)
        self.message = f"engine {url} sent a reply refused: {reason}"
        self.url = url
        self.args = (self.message,)

    def __str__(self) -> str:
        return self.message


class EngineUnreachable(EngineError):
    """No answer: connection refused or reset, or the engine closed the connection (it died)."""

    def __init__(self, url: str, cause: BaseException | str) -> None:
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"engine {url} unreachable ({text})", url)
        self.cause = cause


class EngineTimeout(EngineError):
    """The engine did not answer (connect or read) within the deadline."""

    def __init__(self, url: str, timeout: float | None, cause: BaseException | str) -> None:
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"engine {url} did not answer within {timeout}s ({text})", url)
        self.timeout = timeout
        self.cause = cause


def _decoded(resp: httpx.Response) -> Any:
    """The error answer's JSON (bounded: a hostile error body cannot recurse), or `_NOT_JSON`."""
    try:
        return decode_json(resp.content, "engine error answer")
    except BoundaryError:
        return _NOT_JSON


_NOT_JSON = object()


def server_error_type(resp: httpx.Response) -> str | None:
    """`error.type` of a `{"error": {"type": ...}}` body, else None."""
    body = _decoded(resp)
    error = body.get("error") if isinstance(body, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else None


def server_message(resp: httpx.Response) -> str:
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


def error_from_response(resp: httpx.Response, url: str) -> EngineHTTPError:
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
