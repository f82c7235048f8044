"""Memory release and resume: `/release_memory_occupation`, `/resume_memory_occupation` (SGLang's `tags`).

Owns the handlers and the tag rules (null or [] is every tag of `MEMORY_TAGS`); the release itself is the
scheduler's and the runner's (`memory`). Release needs an idle engine, or one paused with `retract`.

Invariants: a release that cannot write its CPU spill file is a 500 that released nothing; while any memory is
released, `/generate` and `/health_generate` are 503 MemoryReleased (the scheduler refuses them) and `/health`
stays 200.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workers.boundary.json_input import JsonObject
from workers.engine.replies import error, handle
from workers.engine.sampling import RequestError
from workers.engine.sampling_params import show
from workers.engine.scheduler import MEMORY_TAGS, Scheduler

if TYPE_CHECKING:
    from workers.engine.args import EngineArgs

log = logging.getLogger("rayless.engine")


class MemoryCore(Protocol):
    """What the memory routes use of the engine (`workers.engine.server.EngineServer`)."""

    args: EngineArgs
    scheduler: Scheduler


class MemoryRoutes:
    """Release and resume handlers over one engine's scheduler."""

    def __init__(self, server: MemoryCore) -> None:
        self.server = server

    def routes(self) -> list[Route]:
        return [
            Route("/release_memory_occupation", self.release_memory, methods=["POST"]),
            Route("/resume_memory_occupation", self.resume_memory, methods=["POST"]),
        ]

    @staticmethod
    def _tags(body: JsonObject) -> set[str]:
        tags = body.get("tags")
        if tags is None or tags == []:  # SGLang: null or empty means every tag
            return set(MEMORY_TAGS)
        if not isinstance(tags, list) or not all(isinstance(t, str) and t in MEMORY_TAGS for t in tags):
            raise RequestError(f"'tags' must be null or a list drawn from {list(MEMORY_TAGS)}, got {show(tags)}")
        return set(tags)

    async def release_memory(self, request: Request) -> Response:
        async def action(body: JsonObject) -> Response:
            tags = self._tags(body)
            try:
                freed = await self.server.scheduler.release(tags)
            except OSError as exc:  # the CPU spill file could not be written: nothing was freed
                return error(f"release_memory_occupation failed, nothing released: {exc}", 500)
            log.info("released memory %s (%s)", sorted(tags), freed)
            return JSONResponse({"success": True, "message": f"released {sorted(tags)}", **freed})

        return await handle(request, self.server.args.max_request_bytes, action)

    async def resume_memory(self, request: Request) -> Response:
        async def action(body: JsonObject) -> Response:
            tags = self._tags(body)
            try:
                await self.server.scheduler.resume_memory(tags)
            except OSError as exc:
                return error(f"resume_memory_occupation failed: {exc}", 500)
            log.info("resumed memory %s", sorted(tags))
            return JSONResponse({"success": True, "message": f"resumed {sorted(tags)}"})

        return await handle(request, self.server.args.max_request_bytes, action)
