"""The engine's error replies, shared by its route modules.

Owns the shapes: SGLang's `{"error": {"message": ...}}` (`workers.boundary.http_gates`; a 4xx unless said
otherwise), the 503 of a released engine (`type: MemoryReleased` and the released tags, which a health monitor
tells from a dead engine), and `handle`, which reads a JSON body and turns a `RequestError` anywhere in the action into that 400.

Invariant: a rejected input is one of these replies, never a 500 from the exception that found it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from workers.boundary.http_gates import error_response
from workers.boundary.json_input import JsonObject
from workers.engine.http_input import read_json
from workers.engine.sampling_params import RequestError
from workers.engine.sequences import MemoryReleasedError


def error(message: str, status: int = 400) -> JSONResponse:
    return error_response(message, status)  # the one error shape of every rayless server


def released_error(exc: MemoryReleasedError) -> JSONResponse:
    """503 that a health monitor can tell from a dead engine: type MemoryReleased and the released tags."""
    body = {"error": {"message": str(exc), "type": "MemoryReleased", "released": exc.released}}
    return JSONResponse(body, status_code=503)


async def handle(
    request: Request, max_bytes: int, action: Callable[[JsonObject], Awaitable[Response]]
) -> Response:
    """`action` on the request's JSON body; a RequestError (from the body or the action) is a 400."""
    try:
        return await action(await read_json(request, max_bytes))
    except RequestError as exc:
        return error(str(exc))
