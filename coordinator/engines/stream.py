"""The streaming reader of `/generate` with `stream=true`: SGLang's server-sent events, chunk by chunk.

Owns: reading `data:` lines until `[DONE]`, and turning an error status, an error event in the middle of an
HTTP 200 stream, or a transport failure into an `EngineError`. Invariant: never retried once the status
line arrived (the engine has started generating); every read has the caller's deadline.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import httpx

from coordinator.engines.errors import (
    TRANSPORT_ERRORS,
    EngineStreamError,
    error_from_response,
    map_transport_error,
)
from coordinator.engines.policy import request_timeout


async def stream_generate(
    http: httpx.AsyncClient, url: str, body: Mapping[str, Any], *, connect: float, read: float
) -> AsyncGenerator[dict[str, Any]]:
    """POST `body` to `url` (a `/generate` URL) and yield each SSE chunk until `[DONE]`."""
    try:
        async with http.stream("POST", url, json=body, timeout=request_timeout(connect, read)) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                raise error_from_response(resp, url)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk:
                    raise _stream_error(chunk["error"], url)
                yield chunk
    except TRANSPORT_ERRORS as exc:
        raise map_transport_error(exc, url, read) from exc


def _stream_error(err: Any, url: str) -> EngineStreamError:
    """The error of an `{"error": ...}` event: its message and, when it names an integer one, its code."""
    msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    status = err.get("code", 200) if isinstance(err, dict) else 200
    return EngineStreamError(int(status) if isinstance(status, int) else 200, msg, url)
