"""The streaming reader of `/generate` with `stream=true`: SGLang's server-sent events, chunk by chunk.

Owns: reading `data:` lines until `[DONE]`, and turning an error status, an error event in the middle of an
HTTP 200 stream, a stall (`stall`: a head that never comes from an engine that answers nothing, an event line
that drips) or a transport failure into an `EngineError`. Invariant: never retried once the status
line arrived (the engine has started generating); every read has the caller's deadline; each line is read
under the request's reply cap and each chunk is decoded bounded and checked like a plain reply
(`replies`, with `finish_reason` null until the last), so a hostile chunk is one `EngineReplyError`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Mapping
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Protocol

import httpx

from coordinator.engines.bounded import (
    Watch,
    decode_reply,
    generate_reply_limit,
    iter_lines_capped,
    read_prefix,
)
from coordinator.engines.errors import EngineStreamError
from coordinator.engines.replies import check_generate_body_async
from coordinator.engines.stall import HeadWatch, ReplyClock
from coordinator.engines.transport import (
    TRANSPORT_ERRORS,
    error_from_response,
    map_transport_error,
    request_timeout,
)
from workers.boundary.json_input import JsonObject, JsonValue

if TYPE_CHECKING:
    pass


class StreamingClient(Protocol):
    """What the reader needs of the engine client (`client.EngineClient`, which imports this module)."""

    @property
    def http(self) -> httpx.AsyncClient: ...

    connect_timeout: float
    stall_timeout: float
    vocab_size: int | None
    head_watch: HeadWatch

    def stall_watch(self, url: str, what: str, started: float) -> Watch: ...


async def stream_generate(
    client: StreamingClient, base_url: str, body: Mapping[str, JsonValue], *, read: float,
) -> AsyncGenerator[JsonObject]:
    """POST `body` to `base_url`'s `/generate` and yield each SSE chunk, checked, until `[DONE]`."""
    url = base_url + "/generate"
    cap = generate_reply_limit(body)
    started = time.monotonic()
    watch = client.stall_watch(url, "POST /generate (stream)", started)
    try:
        async with AsyncExitStack() as stack:
            with ReplyClock(stall=client.stall_timeout, url=url, base_url=base_url, what="POST /generate (stream)",
                            started=started, watch=client.head_watch, limit=read):
                resp = await stack.enter_async_context(client.http.stream(
                    "POST", url, json=body, timeout=request_timeout(client.connect_timeout, read)))
            if resp.status_code >= 400:
                raise error_from_response(await _capped_answer(resp, url), url)
            async for line in iter_lines_capped(resp, cap, url, watch):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                chunk = await decode_reply(data, url, cap)
                if isinstance(chunk, dict) and "error" in chunk:
                    raise _stream_error(chunk["error"], url)
                await check_generate_body_async(chunk, url, body, client.vocab_size, stream=True)
                yield chunk
    except TRANSPORT_ERRORS as exc:
        raise map_transport_error(exc, url, read) from exc


def _stream_error(err: JsonValue, url: str) -> EngineStreamError:
    """The error of an `{"error": ...}` event: its message and, when it names an integer one, its code."""
    msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    status = err.get("code", 200) if isinstance(err, dict) else 200
    return EngineStreamError(int(status) if isinstance(status, int) else 200, msg, url)


async def _capped_answer(resp: httpx.Response, url: str) -> httpx.Response:
    """An error answer, the beginning of its body read (its text becomes the error's message)."""
    body = await read_prefix(resp)
    return httpx.Response(resp.status_code, content=body, request=resp.request)
