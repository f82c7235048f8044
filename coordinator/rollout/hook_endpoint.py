"""The address hooks post to when no router is used: a small Starlette app in the coordinator whose `/generate`
goes through the rollout's dispatcher.

Owns `HookEndpoint`: two routes on 127.0.0.1 (port chosen by the OS unless given) — `POST /generate` (the body
forwarded to an engine exactly as the default generate path sends its requests, and the engine's answer, once
checked, forwarded as the bytes it came in: the one place an answer leaves the generate path as plain JSON: least-in-flight, the prompt
group kept on one engine, retried on another when its engine dies; engines paused for a weight update hold it
until they resume) and `GET /health` — each answer naming the engine that served it (`X-Rayless-Engine`). A
request carrying a hook call's route (`X-Rayless-Route`, set by `post`) goes to its group's engine (picked
again if that engine died) and, when its sampling params name no seed, gets a deterministic one from (the
rollout seed, rollout, group, sample, context length), as our own requests.

Invariants: served on the shared HTTP layer (`workers.boundary.http_server`: bound before `started`, capped
connections, 16 KiB heads, idle and read deadlines) behind its gates (`http_gates`: the `--sglang-api-key`
as SGLang asks it, 401; bodies over `max_body_bytes`, 413; JSON bounded in depth and size, decoded off the
loop); every failure is a JSON `{"error": {"message"}}` with the status a client can act on (4xx from the
engine passed through, 502 for an engine failure, 503 when no engine is alive), never a traceback.
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from coordinator.engines.errors import EngineError, EngineHTTPError
from coordinator.engines.replies import GenerateAnswer
from coordinator.hooks.runtime import ROUTE_HEADER, HookRoutes
from coordinator.rollout.dispatch import Dispatcher, NoEngineAvailable
from coordinator.rollout.requests import seed_for
from workers.boundary.errors import BoundaryError
from workers.boundary.http_gates import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    BodyTooLarge,
    HttpReply,
    read_json,
    reply_handler,
)
from workers.boundary.http_guard import ServerLimits
from workers.boundary.http_server import AppServer
from workers.boundary.json_input import JsonValue

ENGINE_HEADER = "X-Rayless-Engine"

log = logging.getLogger(__name__)

UNAUTHORIZED = {"error": {"message": "missing or wrong API key (Authorization: Bearer, as --sglang-api-key)"}}


def guarded(app: ASGIApp, *, max_body_bytes: int, api_key: str | None) -> ASGIApp:
    """`app` behind the coordinator servers' gates: body limit, then the API key when one is set."""
    app = BodyLimitMiddleware(app, max_body_bytes)
    return ApiKeyMiddleware(app, api_key, body=UNAUTHORIZED) if api_key else app


class HookEndpoint(AppServer):
    """The coordinator's `/generate` for hooks; `await task_group.start(endpoint.run)` returns once it listens.

    Args:
        dispatcher: the rollout's dispatcher (its engines, its retry on engine death).
        routes: the hook calls in flight (`HookRuntime.routes`).
        seed: the rollout seed (`--rollout-seed`) for the requests' seeds.
        api_key: required from clients when set (`--sglang-api-key`).
        limits: connection limits (`ServerLimits`; `max_connections` overrides its cap).
    """

    DESCRIPTION = "hook endpoint (POST /generate through the rollout's dispatcher)"

    def __init__(self, *, dispatcher: Dispatcher, routes: HookRoutes, seed: int, api_key: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, max_connections: int = 1024,
                 max_body_bytes: int = 64 * 1024 * 1024, limits: ServerLimits | None = None) -> None:
        super().__init__(host=host, port=port, limits=limits or ServerLimits(max_connections=max_connections))
        self.dispatcher = dispatcher
        self.routes = routes
        self.seed = seed
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.requests = 0

    def app(self) -> ASGIApp:
        routes = [Route("/health", self._health, methods=["GET"]),
                  Route("/generate", self._generate_route, methods=["POST"])]
        app = Starlette(routes=routes, exception_handlers={HttpReply: reply_handler, 404: self._not_found,
                                                           405: reply_handler})
        return guarded(app, max_body_bytes=self.max_body_bytes, api_key=self.api_key)

    # --- routes ----------------------------------------------------------------------------------------------
    async def _health(self, _request: Request) -> Response:
        return JSONResponse({})

    async def _not_found(self, request: Request, _exc: HTTPException) -> Response:
        return await reply_handler(request, HttpReply(
            404, f"{request.url.path}: this endpoint serves POST /generate (and GET /health) for hooks"))

    async def _generate_route(self, request: Request) -> Response:
        self.requests += 1
        try:
            payload = await read_json(request, self.max_body_bytes)
        except BodyTooLarge as error:
            raise HttpReply(413, str(error)) from None
        except BoundaryError as error:
            raise HttpReply(400, f"the body is not JSON this endpoint takes ({error.reason}): SGLang's "
                            "/generate request is a JSON object") from None
        answer, url = await self._generate(payload, request.headers.get(ROUTE_HEADER))
        # the engine's bytes as they came (checked, not re-encoded): its NaN logprobs too are not ours to refuse
        return Response(answer.body, media_type="application/json", headers={ENGINE_HEADER: url})

    async def _generate(self, payload: dict[str, JsonValue], token: str | None) -> tuple[GenerateAnswer, str]:
        route = self.routes.get(token)
        engine = None
        if route is not None and self.dispatcher.router_url is None:
            group = route.group
            if group.engine is None or not getattr(group.engine, "alive", True):
                try:
                    group.engine = await self.dispatcher.pick()
                except NoEngineAvailable as error:  # the group's engine died and none is left: 503, as below
                    raise HttpReply(503, str(error)) from None
            engine = group.engine
            params = payload.get("sampling_params")
            if isinstance(params, dict) and "sampling_seed" not in params:
                progress = len(payload.get("input_ids") or payload.get("text") or ())
                payload["sampling_params"] = {**params, "sampling_seed": seed_for(
                    self.seed, group.rollout_id, group.group_index, route.sample_index, progress)}
        try:
            answer, url = await self.dispatcher.generate(payload, engine=engine)
            if route is not None and engine is not None and url != engine.url:
                # Its engine died and another answered: the group sticks to that one from now on.
                pool = self.dispatcher.pool
                route.group.engine = next((h for h in (pool.alive() if pool else ()) if h.url == url), None)
            return answer, url
        except EngineHTTPError as error:
            raise HttpReply(error.status if 400 <= error.status < 500 else 502, error.server_message) from None
        except NoEngineAvailable as error:
            raise HttpReply(503, str(error)) from None
        except EngineError as error:
            raise HttpReply(502, str(error)) from None
