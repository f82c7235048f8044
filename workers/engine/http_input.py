"""The engine's side of the shared request gates (`workers.boundary.http_gates`): its limits and its errors.

Owns `read_json` (every JSON endpoint of the engine reads its body through it) and re-exports the gates the
app is wrapped in (`AdminKeyMiddleware`, `BodyLimitMiddleware`), so the route modules keep one import.

Invariants (the shared layer's, with the engine's numbers): no body larger than `--max-request-bytes` is read
into memory (a declared one is a 413 before the app runs, a chunked one a 400 once it passes the limit); JSON
nested deeper than `MAX_JSON_DEPTH`, holding NaN/Infinity (SGLang's orjson refuses them too) or too many values
is a 400, never a RecursionError 500; a large body is decoded off the event loop; a client that disconnects
before its body is complete costs one log line (`ClientGone`), not a traceback.
"""

from __future__ import annotations

from starlette.requests import Request

from workers.boundary.errors import BoundaryError
from workers.boundary.http_gates import AdminKeyMiddleware, ApiKeyMiddleware, BodyLimitMiddleware
from workers.boundary.http_gates import ClientGone as _Gone
from workers.boundary.http_gates import read_json as _read_json
from workers.boundary.json_input import JsonLimits, JsonObject
from workers.engine.sampling_params import RequestError

__all__ = ["MAX_JSON_DEPTH", "AdminKeyMiddleware", "ApiKeyMiddleware", "BodyLimitMiddleware", "ClientGone",
           "read_json"]

MAX_JSON_DEPTH = 32  # SGLang's bodies need 4 (custom_params objects); 32 leaves room and bounds the work
LIMIT_NAME = "the engine's --max-request-bytes"


class ClientGone(RequestError):
    """The client disconnected before its body was complete; the answer goes nowhere."""


async def read_json(request: Request, max_bytes: int) -> JsonObject:
    """The body as a JSON object ({} when empty); RequestError (400) otherwise."""
    limits = JsonLimits(max_bytes=max(max_bytes, 1), max_depth=MAX_JSON_DEPTH)
    try:
        return await _read_json(request, max_bytes, limits=limits, limit_name=LIMIT_NAME)
    except _Gone:
        raise ClientGone("client disconnected") from None
    except BoundaryError as error:
        raise RequestError(str(error)) from None
