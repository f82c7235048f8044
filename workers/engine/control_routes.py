"""Generation control: `/pause_generation`, `/continue_generation`, `/abort_request`, `/flush_cache`.

Owns the handlers; the states they change are the scheduler's. Pause modes as SGLang: `abort` (the default)
ends what runs, `retract` puts it back in the queue and drops the cache, `in_place` holds it; a paused engine
admits nothing new but health probes. `/flush_cache` is a 400 while anything runs or waits.

Invariant: a rejected body is a 400 `{"error": {"message": ...}}` and changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from workers.boundary.json_input import JsonObject
from workers.engine.replies import handle
from workers.engine.sampling import RequestError

if TYPE_CHECKING:
    from workers.engine.args import EngineArgs
    from workers.engine.scheduler import Scheduler


class ControlCore(Protocol):
    """What the control routes use of the engine (`workers.engine.server.EngineServer`)."""

    args: EngineArgs
    scheduler: Scheduler


class ControlRoutes:
    """Pause, continue, abort and flush handlers over one engine's scheduler."""

    def __init__(self, server: ControlCore) -> None:
        self.server = server

    def routes(self) -> list[Route]:
        post = ["POST"]
        return [
            Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
            Route("/abort_request", self.abort_request, methods=post),
            Route("/pause_generation", self.pause_generation, methods=post),
            Route("/continue_generation", self.continue_generation, methods=post),
        ]

    async def flush_cache(self, request: Request) -> Response:
        if await self.server.scheduler.flush():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed because there are running or waiting requests.\n", 400)

    async def abort_request(self, request: Request) -> Response:
        async def action(body: JsonObject) -> Response:
            rid = body.get("rid")
            if rid is not None and not isinstance(rid, str):
                raise RequestError("'rid' must be a string")
            count = self.server.scheduler.abort(rid=rid, abort_all=bool(body.get("abort_all", False)))
            return JSONResponse({"success": True, "num_aborted": count})

        return await handle(request, self.server.args.max_request_bytes, action)

    async def pause_generation(self, request: Request) -> Response:
        async def action(body: JsonObject) -> Response:
            await self.server.scheduler.pause(str(body.get("mode", "abort")))
            return JSONResponse({"success": True, "message": "Generation paused successfully."})

        return await handle(request, self.server.args.max_request_bytes, action)

    async def continue_generation(self, request: Request) -> Response:
        self.server.scheduler.resume()
        return JSONResponse({"success": True, "message": "Generation continued successfully."})
