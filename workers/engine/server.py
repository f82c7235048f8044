"""The engine's HTTP server: SGLang's endpoints over Starlette, served by uvicorn (docs/engine.md).

Owns the engine's state (the runner, the scheduler, the model path and context length, whether it serves),
the route table built from the route modules — `/generate` (`generate_routes`, its input rules in
`generate_request`), health, info and metrics (`info_routes`), generation control (`control_routes`), memory
release and resume (`memory_routes`), weight updates (`weight_routes`), the OpenAI-compatible `/v1` routes
(`openai_routes`), Anthropic's `/v1/messages` (`anthropic_routes`), OpenAI's `/v1/responses`
(`responses_routes`) — the gates every request passes first (API key, body size: `http_input`), the lifespan,
and `serve` (on the shared HTTP layer, `workers.boundary.http_server`). Each route module meets the engine
through a Protocol of what it uses, so none imports this one.

Invariant: the port opens only after the weights are loaded (as SGLang); the scheduler's task runs exactly as
long as the app serves, and at shutdown every sequence is aborted and every weight-update group left.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.types import ASGIApp

from workers import stack_dumps
from workers.boundary.engine_routes import is_admin
from workers.boundary.http_server import serve_process
from workers.boundary.json_input import JsonObject
from workers.engine.anthropic_routes import AnthropicRoutes
from workers.engine.args import EngineArgs
from workers.engine.batch_invariant import BatchInvariantRunner
from workers.engine.control_routes import ControlRoutes
from workers.engine.generate_request import RequestBuilder
from workers.engine.generate_routes import GenerateRoutes
from workers.engine.http_input import LIMIT_NAME, AdminKeyMiddleware, BodyLimitMiddleware
from workers.engine.info_routes import InfoRoutes
from workers.engine.memory_routes import MemoryRoutes
from workers.engine.openai_routes import OpenAIRoutes
from workers.engine.rescoring import Rescorer
from workers.engine.responses_routes import ResponsesRoutes
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler
from workers.engine.sequences import RequestGroup, Seq
from workers.engine.weight_routes import WeightRoutes

log = logging.getLogger("rayless.engine")


class EngineServer:
    """Holds the runner, the scheduler and the server-level state; builds the app from the route modules."""

    def __init__(self, args: EngineArgs, runner: ModelRunner) -> None:
        self.args = args
        self.runner = runner
        self.model_path = args.model_path
        self.context_length = args.context_length or int(
            getattr(runner.config.get_text_config(), "max_position_embeddings", 0) or 4096
        )
        self.scheduler = Scheduler(
            runner,
            max_running=args.max_running_requests,
            weight_version=args.weight_version,
            seed=args.random_seed,
        )
        if args.rl_on_policy_target is not None:
            self.scheduler.rescorer = Rescorer(runner, chunk_size=args.log_probs_chunk_size).rescore
        self.serving = False
        self.probe_ids: list[int] = runner.tokenizer.encode("1", add_special_tokens=False) or [0]
        self.requests = RequestBuilder(self)
        self.generation = GenerateRoutes(self)
        self.weights = WeightRoutes(self)  # holds the weight-update groups this engine joined

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # ---- what /generate and the /v1 routes share ------------------------------------------------------

    async def build(self, body: JsonObject, *, expand_images: bool = False) -> tuple[list[Seq], bool, RequestGroup]:
        """Validate a /generate body whole and make its sequences (`RequestBuilder.build`)."""
        return await self.requests.build(body, expand_images=expand_images)

    async def expand_images(self, ids: list[int], urls: list[str]) -> list[int]:
        """A rendered prompt's ids with each image's placeholder expanded to its grid's tokens, as `build` expands
        them (the same decoding, bounds and errors): a count of the tokens the prompt will take."""
        prompts = [list(ids)]
        await self.requests._images({"image_data": urls}, prompts, from_text=True)
        return prompts[0]

    def render(self, seq: Seq, *, with_text: bool, final: bool) -> JsonObject:
        return self.generation.render(seq, with_text=with_text, final=final)

    async def wait_or_disconnect(self, request: Request, group: RequestGroup) -> None:
        await self.generation.wait_or_disconnect(request, group)

    # ---- app --------------------------------------------------------------------------------------------

    def app(self) -> ASGIApp:
        routes = [
            *self.generation.routes(),  # /generate
            *InfoRoutes(self).routes(),  # /health, /health_generate, /model_info, /server_info, /metrics, ...
            *ControlRoutes(self).routes(),  # /pause_generation, /continue_generation, /abort_request, ...
            *MemoryRoutes(self).routes(),  # /release_memory_occupation, /resume_memory_occupation
            *self.weights.routes(),  # /update_weights_from_disk, /init_weights_update_group, ...
            *OpenAIRoutes(self).routes(),  # /v1/chat/completions, /v1/completions, /v1/models
            *AnthropicRoutes(self).routes(),  # /v1/messages, /v1/messages/count_tokens
            *ResponsesRoutes(self).routes(),  # /v1/responses
        ]
        app: ASGIApp = Starlette(routes=routes, lifespan=self.lifespan)
        app = BodyLimitMiddleware(app, self.args.max_request_bytes, limit_name=LIMIT_NAME)
        if self.args.api_key or self.args.admin_api_key:  # SGLang's levels: control routes take the admin key
            app = AdminKeyMiddleware(app, api_key=self.args.api_key, admin_api_key=self.args.admin_api_key,
                                     is_admin=is_admin)
        return app

    @asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            await tg.start(self.scheduler.run)
            self.serving = True
            log.info("serving %s on http://%s:%d", self.model_path, self.args.host, self.args.port)
            try:
                yield
            finally:
                self.serving = False
                self.scheduler.abort(abort_all=True, message="server shutting down")
                self.weights.close()
                self.runner.stash.discard()
                tg.cancel_scope.cancel()


def _configure_threads() -> None:
    raw = os.environ.get("RAYLESS_ENGINE_THREADS", "1")
    try:
        threads = int(raw)
    except ValueError:
        raise SystemExit(f"rayless engine: RAYLESS_ENGINE_THREADS={raw!r} is not an integer (the engine's "
                         "intra-op thread count)") from None
    torch.set_num_threads(max(1, threads))


def serve(args: EngineArgs) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    _configure_threads()
    stack_dumps.install(f"engine-{args.port}")  # `rayless stacks` (a run's engines; by hand: no-op)
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    started = time.perf_counter()
    # The first line of the log: the launcher reads "the engine writes its log" as "it is loading".
    log.info("loading the model from %s on %s (%s)", args.model_path, args.device, args.dtype)
    try:
        runner_class = BatchInvariantRunner if args.enable_deterministic_inference else ModelRunner
        runner = runner_class(
            args.model_path,
            tokenizer_path=args.tokenizer_path,
            dtype=args.dtype,
            device=args.device,
            weight_spill_dir=args.weight_spill_dir,
            attn_implementation=args.attn_implementation,
        )
    except (OSError, ValueError) as exc:  # FileNotFoundError included: a bad --model-path is the usual cause
        log.error("cannot load the model from %s: %s", args.model_path, exc)
        return 2
    server = EngineServer(args, runner)
    if not args.skip_server_warmup:
        # One forward before the port opens, so the first request does not pay for lazy initialisation.
        with torch.inference_mode():
            runner.model(input_ids=torch.tensor([server.probe_ids], device=runner.device))
    log.info(
        "model loaded from %s on %s (%s) in %.1f s",
        args.model_path,
        runner.device,
        next(runner.model.parameters()).dtype,
        time.perf_counter() - started,
    )
    # The shared HTTP layer: socket bound first, capped connections, 16 KiB heads, idle and read deadlines.
    serve_process(server.app(), args.host, args.port, log_level=args.log_level,
                  access_log=args.log_level == "debug", lifespan="on", graceful_s=5)
    return 0
