"""`rayless tinker-server`'s HTTP service: the Tinker REST API as the official `tinker` SDK calls it.

Owns `TinkerServer` (the routes, the API key, the bounds on bodies) and `BaseModel` (a base model it may
load). Long calls (create_model, forward_backward, optim_step, the saves and loads, asample) answer a future
at once (`futures`); training calls queue on their model in the client's order (`models`), sampling runs on an
engine per base model (`sampling`), sessions end by `finish` or silence (`sessions`). Protobuf bodies are read
and written by `wire`, JSON ones decoded through the boundary layer and validated by `requests`.

Invariants: every answer is JSON (or the protobuf the SDK asks for) and every refusal a 4xx with
`{"detail": ...}` naming the call and why — never a 5xx for the caller's mistake, which the SDK would retry for
minutes; the API key, when given, is asked of every call but the health probe; each body is bounded
(`--max-body-bytes`, `--max-batch-datums`, `--max-tokens`) before it is decoded whole.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from coordinator.engines.client import EngineClient
from coordinator.engines.errors import EngineError
from coordinator.tinker import requests as req
from coordinator.tinker import status
from coordinator.tinker.futures import PROTOBUF, Future, FutureStore, UserError
from coordinator.tinker.models import TrainingModel, Work
from coordinator.tinker.sampling import Sampler
from coordinator.tinker.sessions import Session, Sessions
from coordinator.tinker.wire import WireError, decode_forward_backward, encode_forward_backward_output
from coordinator.train.commands import TrainCommands
from workers import protocol
from workers.boundary.errors import BoundaryError
from workers.boundary.http_gates import BodyLimitMiddleware, BodyTooLarge, HttpReply, MethodGate, read_body
from workers.boundary.http_guard import ServerLimits
from workers.boundary.http_server import AppServer
from workers.boundary.json_input import JsonLimits, JsonValue, decode_json_async
from workers.protocol.train_settings import LoraSettings

log = logging.getLogger("rayless.tinker")

PREFIX = "/api/v1/"
#: the SDK's calls this service does not serve, each refused by name (a 400: the SDK does not retry it)
UNSUPPORTED = {
    "create_custom_loss": "custom losses (forward_backward_custom runs them client-side without this call)",
    "save_weights_external": "save_weights_external (use `rayless export` on a sampler checkpoint)",
    "copy_weights": "copy_weights", "retrieve_futures": "retrieve_futures (the SDK polls retrieve_future)",
    "join_sampling_session": "join_sampling_session", "cancel_future": "cancel_future",
    "auth/token": "JWT auth (give the service's --api-key as TINKER_API_KEY)", "weights_info": "weights_info",
    "training_runs": "the training-runs REST listing", "checkpoints": "the checkpoints REST listing",
    "samplers": "the samplers REST listing", "sessions": "the sessions REST listing", "audit": "audit logs",
    "billing": "billing", "auth/apikey/me": "whoami",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TINKER_PATH = re.compile(r"^tinker://([A-Za-z0-9._:-]+)/(weights|sampler_weights)/([A-Za-z0-9._-]+)$")
LORA_ALPHA = 32.0
#: beside a model's checkpoints: its base model and adapters, what a create-from-checkpoint rebuilds
MODEL_RECORD = "model.json"
#: unnamed sampler snapshots kept per model (older ones are deleted: their sampling sessions then fail)
EPHEMERAL_KEPT = 3


@dataclass(frozen=True)
class BaseModel:
    """A base model the service may load: its name (what clients ask for) and local Hugging Face directory."""

    name: str
    path: str
    vocab_size: int
    max_context: int
    arch: str
    tied_head: bool

    @classmethod
    def read(cls, name: str, path: str) -> BaseModel:
        config_file = Path(path) / "config.json"
        try:
            config = json.loads(config_file.read_text())
            return cls(name=name, path=str(Path(path).resolve()), vocab_size=int(config["vocab_size"]),
                       max_context=int(config.get("max_position_embeddings") or 0),
                       arch=str((config.get("architectures") or ["?"])[0]),
                       tied_head=bool(config.get("tie_word_embeddings", False)))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"--base-model {name}={path}: not a Hugging Face model directory "
                             f"({config_file}: {error})") from None


@dataclass(frozen=True)
class Limits:
    max_models: int = 2
    max_batch_datums: int = 1024
    max_tokens: int = 8192
    max_batch_tokens: int = 262144
    max_samples: int = 64
    max_body_bytes: int = 256 * 1024 * 1024
    max_json_bytes: int = 16 * 1024 * 1024


class TinkerServer(AppServer):
    DESCRIPTION = "Tinker API service (rayless tinker-server)"

    def __init__(self, *, base_models: list[BaseModel], run_dir: Path, api_key: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, ranks: int = 1, limits: Limits | None = None,
                 session_timeout_s: float = 60.0, poll_s: float = 10.0, torch_threads: int = 1,
                 data_parallel: str = "auto", sampler_urls: dict[str, str] | None = None,
                 sampler_api_key: str | None = None) -> None:
        super().__init__(host=host, port=port, limits=ServerLimits())
        self.base_models = {model.name: model for model in base_models}
        self.run_dir = run_dir
        self.api_key = api_key
        self.ranks = ranks
        self.bounds = limits or Limits()
        self.torch_threads = torch_threads
        self.data_parallel = data_parallel
        self.futures = FutureStore(poll_s=poll_s)
        self.sessions = Sessions(timeout_s=session_timeout_s, on_end=self._session_ended)
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        #: base model name → a running engine it samples on (--sampler-url), instead of one launched here
        self.sampler_urls = dict(sampler_urls or {})
        self.sampler_api_key = sampler_api_key
        #: sampling session id → (base model name, the weights' local path or None for the base model)
        self.sampling: dict[str, tuple[str, str | None]] = {}
        #: tinker:// sampler paths → their snapshot directory
        self.sampler_dirs: dict[str, str] = {}
        self._ids = itertools.count(1)
        self._tasks: anyio.abc.TaskGroup | None = None
        self._client: EngineClient | None = None

    # ---------------------------------------------------------------------------------------------- lifetime
    async def run(self, *, task_status: anyio.abc.TaskStatus[TinkerServer] = anyio.TASK_STATUS_IGNORED) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        async with EngineClient(max_connections=64, api_key=self.sampler_api_key) as client:
            self._client = client
            try:
                async with anyio.create_task_group() as tasks:
                    self._tasks = tasks
                    tasks.start_soon(self.sessions.sweep)
                    await tasks.start(super().run)
                    log.info("tinker-server on %s (run dir %s)", self.url, self.run_dir)
                    task_status.started(self)
            finally:
                with anyio.CancelScope(shield=True):
                    for sampler in self.samplers.values():
                        await sampler.stop()

    def _session_ended(self, session: Session, why: str) -> None:
        for model_id in session.models:
            model = self.models.get(model_id)
            if model is not None:
                model.stop(f"its session ended: {why}")
        for sampling_id in session.samplers:
            self.sampling.pop(sampling_id, None)
        log.info("session %s ended (%s)", session.session_id, why)

    def metrics(self) -> str:
        """Prometheus text: what the service holds now and what it has served."""
        figures = {"tinker_sessions_live": len(self.sessions.live), "tinker_models_live": len(self.live_models()),
                   "tinker_samplers_started": sum(s.api is not None for s in self.samplers.values()),
                   "tinker_futures_pending": self.futures.pending(),
                   "tinker_requests_queued": sum(m.queued() for m in self.live_models()),
                   "tinker_optim_steps_total": sum(m.steps for m in self.models.values())}
        return "".join(f"# TYPE {name} {'counter' if name.endswith('_total') else 'gauge'}\n{name} {value}\n"
                       for name, value in figures.items())

    def live_models(self) -> list[TrainingModel]:
        return [model for model in self.models.values() if model.stopped is None]

    # ---------------------------------------------------------------------------------------------- routes
    def app(self) -> ASGIApp:
        app = Starlette(routes=[Route("/{path:path}", self._route, methods=["GET", "POST", "PUT", "DELETE"])],
                        exception_handlers={HttpReply: _reply})
        return MethodGate(BodyLimitMiddleware(app, self.bounds.max_body_bytes, limit_name="--max-body-bytes"))

    async def _route(self, request: Request) -> Response:
        path = request.url.path
        if path in ("/api/v1/healthz", "/health", "/healthz"):
            return _json({"status": "ok"})
        if path == "/" and request.method == "GET":  # static, no data: it asks /status with the key it is given
            return HTMLResponse(status.PAGE)
        self._check_key(request)
        if path == "/metrics":
            return Response(self.metrics(), media_type="text/plain; version=0.0.4")
        if path == "/status":
            return _json(status.document(base_models=self.base_models, sessions=self.sessions, models=self.models,
                                         samplers=self.samplers, futures=self.futures))
        if not path.startswith(PREFIX):
            raise HttpReply(404, f"{path}: the Tinker API is served under {PREFIX}")
        call = path[len(PREFIX):]
        handler = self._handlers().get(call)
        if handler is not None:
            try:
                return await handler(request)
            except (HttpReply, anyio.get_cancelled_exc_class()):
                raise
            except Exception as error:  # our bug: a 5xx would have the SDK retry it for minutes, a hang to its user
                log.exception("%s failed", call)
                raise HttpReply(400, f"{call}: rayless tinker-server failed on this call ({type(error).__name__}: "
                                f"{error}); its log has the traceback") from None
        sampler = re.fullmatch(r"samplers/([^/]+)", call)
        if sampler and request.method == "GET":
            target = self.sampling.get(sampler.group(1))
            if target is None:
                raise HttpReply(404, f"unknown sampling session {sampler.group(1)!r}")
            model_path = next((path for path, snapshot in self.sampler_dirs.items() if snapshot == target[1]), None)
            return _json({"sampler_id": sampler.group(1), "base_model": target[0], "model_path": model_path})
        session_finish = re.fullmatch(r"sessions/([^/]+)/finish", call)
        if session_finish:
            self.sessions.end(session_finish.group(1), "finished by the client")
            return _json({})
        refused = next((why for name, why in UNSUPPORTED.items() if call == name or call.startswith(name + "/")),
                       None)
        if refused is not None:
            raise HttpReply(400, f"{call}: {refused} is not supported by rayless tinker-server")
        raise HttpReply(404, f"{call}: not a Tinker API call this service knows")

    def _handlers(self) -> dict[str, Callable[[Request], Awaitable[Response]]]:
        return {
            "get_server_capabilities": self._capabilities, "client/config": self._client_config,
            "client/dynamic_config": self._dynamic_config, "telemetry": self._telemetry,
            "create_session": self._create_session, "session_heartbeat": self._heartbeat,
            "create_model": self._create_model, "get_info": self._get_info,
            "forward_backward": self._forward_backward, "optim_step": self._optim_step,
            "save_weights": self._save_weights, "save_weights_for_sampler": self._save_for_sampler,
            "load_weights": self._load_weights, "create_sampling_session": self._create_sampling_session,
            "asample": self._asample, "retrieve_future": self._retrieve_future,
        }

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if not secrets.compare_digest(given.encode(), self.api_key.encode()):
            raise HttpReply(401, "this service needs its API key (X-API-Key, the SDK's TINKER_API_KEY)")

    async def _body(self, request: Request, call: str) -> JsonValue:
        try:
            raw = await read_body(request, self.bounds.max_json_bytes, limit_name="the JSON body limit")
            return await decode_json_async(raw or b"{}", f"{call} body", JsonLimits(max_bytes=self.bounds.max_json_bytes))
        except BodyTooLarge as error:
            raise HttpReply(413, f"{call}: {error}") from None
        except BoundaryError as error:
            raise HttpReply(400, f"{call}: invalid JSON body: {error.reason}") from None

    def _model(self, model_id: str, call: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None:
            raise HttpReply(404, f"{call}: unknown model_id {model_id!r}")
        if model.stopped is not None:
            raise HttpReply(400, f"{call}: model {model_id} is stopped: {model.stopped}")
        return model

    def _base(self, name: str, call: str) -> BaseModel:
        base = self.base_models.get(name)
        if base is None:
            raise HttpReply(400, f"{call}: unknown base_model {name!r}; this service loads "
                            f"{', '.join(sorted(self.base_models))} (--base-model NAME=PATH)")
        return base

    def _submit(self, model: TrainingModel, seq_id: int | None, work: Work) -> Response:
        try:
            future = model.submit(seq_id, work)
        except UserError as error:
            raise HttpReply(400, str(error)) from None
        return _json({"request_id": future.request_id, "model_id": model.model_id})

    # ---------------------------------------------------------------------------------------------- service
    async def _capabilities(self, _request: Request) -> Response:
        return _json({"supported_models": [
            {"model_name": m.name, "max_context_length": m.max_context or None, "trainable": True, "sampleable": True}
            for m in self.base_models.values()]})

    async def _client_config(self, _request: Request) -> Response:
        # plain httpx, uncompressed protobuf, batches chunked at the service's own bound, one sample per poll
        return _json({"use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                      "parallel_fwdbwd_chunks": False, "fwdbwd_max_chunk_len": self.bounds.max_batch_datums,
                      "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                      "sample_join_sampling_session": False, "pjwt_auth_enabled": False})

    async def _dynamic_config(self, _request: Request) -> Response:
        return _json({"refresh_interval_sec": 3600, "sample_cancel_enabled": False})

    async def _telemetry(self, _request: Request) -> Response:
        return _json({"status": "accepted"})  # the SDK's diagnostics are not kept

    async def _create_session(self, request: Request) -> Response:
        await self._body(request, "create_session")
        return _json({"type": "create_session", "session_id": self.sessions.create().session_id})

    async def _heartbeat(self, request: Request) -> Response:
        body = req.convert(await self._body(request, "session_heartbeat"), req.SessionRef, "session_heartbeat")
        self.sessions.get(body.session_id)
        return _json({"type": "session_heartbeat"})

    async def _retrieve_future(self, request: Request) -> Response:
        body = req.convert(await self._body(request, "retrieve_future"), req.RetrieveFuture, "retrieve_future")
        data, kind = await self.futures.retrieve(body.request_id)
        return Response(data, media_type=kind)

    # ---------------------------------------------------------------------------------------------- training
    async def _create_model(self, request: Request) -> Response:
        body = req.convert(await self._body(request, "create_model"), req.CreateModel, "create_model")
        session = self.sessions.get(body.session_id)
        base = self._base(body.base_model, "create_model")
        if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
            raise HttpReply(400, f"create_model: optimizer {body.optimizer_config.type!r} is not supported "
                            "(this service trains with Adam)")
        lora = None
        if body.lora_config is not None:
            config = body.lora_config
            modules = ((("q_proj", "k_proj", "v_proj", "o_proj") if config.train_attn else ())
                       + (("gate_proj", "up_proj", "down_proj") if config.train_mlp else ())
                       + (("lm_head",) if config.train_unembed and not base.tied_head else ()))
            if config.rank < 1 or not modules:
                raise HttpReply(400, "create_model: lora_config needs rank >= 1 and a module to train")
            lora = LoraSettings(rank=config.rank, alpha=LORA_ALPHA, target_modules=modules)
        seed = body.lora_config.seed if body.lora_config is not None and body.lora_config.seed is not None else 0
        model = self._new_model(session, body.model_seq_id, base, lora, seed, "create_model")
        future = self.futures.create()
        assert self._tasks is not None
        self._tasks.start_soon(model.serve, future)
        return _json({"request_id": future.request_id, "model_id": model.model_id})

    def _new_model(self, session: Session, model_seq_id: int, base: BaseModel, lora: LoraSettings | None,
                   seed: int, call: str) -> TrainingModel:
        """A model under the id the SDK derives itself (`{session}:train:{seq}`), its record on disk (what a
        later create-from-checkpoint rebuilds it from)."""
        model_id = f"{session.session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise HttpReply(400, f"{call}: model {model_id} exists (model_seq_id {model_seq_id} taken)")
        if len(self.live_models()) >= self.bounds.max_models:
            raise HttpReply(400, f"{call}: the service holds its --max-models {self.bounds.max_models} "
                            "models; end a session (or its client) to free one")
        model = TrainingModel(model_id=model_id, session_id=session.session_id, base_name=base.name,
                              base_path=base.path, lora=lora, seed=seed, ranks=self.ranks, run_dir=self.run_dir,
                              futures=self.futures, torch_threads=self.torch_threads,
                              data_parallel=self.data_parallel)
        model.dir.mkdir(parents=True, exist_ok=True)
        record = {"base_model": base.name, "seed": seed,
                  "lora": None if lora is None else {"rank": lora.rank, "target_modules": list(lora.target_modules)}}
        (model.dir / MODEL_RECORD).write_text(json.dumps(record))
        self.models[model_id] = model
        session.models.append(model_id)
        return model

    async def _get_info(self, request: Request) -> Response:
        body = req.convert(await self._body(request, "get_info"), req.ModelRef, "get_info")
        model = self._model(body.model_id, "get_info")
        base = self.base_models[model.base_name]
        return _json({"type": "get_info", "model_id": model.model_id, "model_name": base.name,
                      "model_data": {"arch": base.arch, "model_name": base.name, "tokenizer_id": base.path},
                      "is_lora": model.lora is not None,
                      "lora_rank": model.lora.rank if model.lora is not None else None})

    async def _forward_backward(self, request: Request) -> Response:
        if request.headers.get("content-encoding", "identity") != "identity":
            raise HttpReply(415, "forward_backward: send the body uncompressed (the service's client config says "
                            "proto_compress_fwdbwd false)")
        try:
            raw = await read_body(request, self.bounds.max_body_bytes, limit_name="--max-body-bytes")
            parsed = await anyio.to_thread.run_sync(lambda: decode_forward_backward(
                raw, max_datums=self.bounds.max_batch_datums, max_tokens=self.bounds.max_tokens))
        except BodyTooLarge as error:
            raise HttpReply(413, f"forward_backward: {error}") from None
        except WireError as error:
            raise HttpReply(400, f"forward_backward: {error}") from None
        model = self._model(parsed.model_id, "forward_backward")
        req.refuse_loss(parsed.loss_fn)
        data = req.training_data(parsed, self.base_models[model.base_name].vocab_size)
        total = sum(len(datum.tokens) for datum in data)
        if total > self.bounds.max_batch_tokens:
            raise HttpReply(400, f"forward_backward: {total} tokens in one request, over the service's "
                            f"--max-batch-tokens {self.bounds.max_batch_tokens}")
        config = {key: float(value) for key, value in parsed.loss_config.items()}

        async def work(commands: TrainCommands) -> tuple[bytes, str]:
            reply = await commands.forward_backward(data, parsed.loss_fn, config, forward_only=parsed.forward_only)
            model.rank_seconds["forward" if parsed.forward_only else "forward_backward"] = reply.seconds
            outputs = {"logprobs": reply.logprobs, "elementwise_loss": reply.elementwise_loss}
            metrics = {"loss:sum": reply.loss_sum, "rank_seconds:max": reply.seconds}
            return encode_forward_backward_output(outputs, metrics), PROTOBUF

        return self._submit(model, parsed.seq_id, work)

    async def _optim_step(self, request: Request) -> Response:
        body = req.convert(await self._body(request, "optim_step"), req.OptimStep, "optim_step")
        model = self._model(body.model_id, "optim_step")
        if body.adam_params is None:
            kind = (body.optimizer_params or {}).get("type", "?")
            raise HttpReply(400, f"optim_step: optimizer params of type {kind!r} are not supported (Adam only)")
        adam = body.adam_params
        if not (adam.learning_rate >= 0 and 0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1 and adam.eps > 0):
            raise HttpReply(400, "optim_step: adam_params need learning_rate >= 0, betas in [0, 1) and eps > 0")
        command = protocol.OptimStepCommand(learning_rate=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2,
                                            eps=adam.eps, weight_decay=adam.weight_decay,
                                            grad_clip_norm=adam.grad_clip_norm)

        async def work(commands: TrainCommands) -> tuple[bytes, str]:
            reply = await commands.optim_step(command)
            model.steps += 1
            model.rank_seconds["optim_step"] = reply.seconds
            metrics = {"grad_norm:mean": reply.grad_norm, "rank_seconds:max": reply.seconds}
            return json.dumps({"metrics": metrics}).encode(), "application/json"

        return self._submit(model, body.seq_id, work)

    def _checkpoint_name(self, name: str | None, call: str, default: str) -> str:
        name = name or default
        if not _NAME.match(name):
            raise HttpReply(400, f"{call}: a checkpoint name is 1-128 of A-Z a-z 0-9 . _ -, got {name[:64]!r}")
        return name

    async def _save_weights(self, request: Request) -> Response:
        body = req.convert(await self._body(request, "save_weights"), req.SaveWeights, "save_weights")
        model = self._model(body.model_id, "save_weights")
        name = self._checkpoint_name(body.path, "save_weights", f"step-{model.steps}")
        directory = model.dir / "weights" / name

        async def work(commands: TrainCommands) -> tuple[bytes, str]:
            await commands.save(model.steps, directory=directory)
            path = f"tinker://{model.model_id}/weights/{name}"
            return json.dumps({"path": path, "type": "save_weights"}).encode(), "application/json"

        return self._submit(model, body.seq_id, work)

    async def _save_for_sampler(self, request: Request) -> Response:
        call = "save_weights_for_sampler"
        body = req.convert(await self._body(request, call), req.SaveWeights, call)
        model = self._model(body.model_id, call)
        ephemeral = body.path is None
        name = self._checkpoint_name(body.path, call, f"sampler-{next(self._ids)}")
        session = self.sessions.live.get(model.session_id)

        async def work(commands: TrainCommands) -> tuple[bytes, str]:
            # a named checkpoint in its own directory, kept; the unnamed ones (save_weights_and_get_sampling_client,
            # once per RL step) share one, of which the export keeps the newest EPHEMERAL_KEPT
            directory = model.dir / "sampler_weights" / ("_ephemeral" if ephemeral else name)
            snapshot = await commands.export_weights(directory, name, keep=EPHEMERAL_KEPT if ephemeral else 1)
            path = f"tinker://{model.model_id}/sampler_weights/{name}"
            self.sampler_dirs[path] = str(snapshot)
            if not ephemeral:
                return json.dumps({"path": path, "type": call}).encode(), "application/json"
            sampling_id = f"sampling-{next(self._ids)}"
            self.sampling[sampling_id] = (model.base_name, str(snapshot))
            if session is not None:
                session.samplers.append(sampling_id)
            return json.dumps({"sampling_session_id": sampling_id, "type": call}).encode(), "application/json"

        return self._submit(model, body.seq_id, work)

    async def _load_weights(self, request: Request) -> Response:
        body = req.convert(await self._body(request, "load_weights"), req.LoadWeights, "load_weights")
        match = _TINKER_PATH.match(body.path)
        if match is None or match.group(2) != "weights":
            raise HttpReply(400, f"load_weights: {body.path[:200]!r} is not a tinker://MODEL/weights/NAME path "
                            "save_weights answered")
        source = self.run_dir / "models" / match.group(1)
        directory = source / "weights" / match.group(3)
        if not directory.is_dir():
            raise HttpReply(404, f"load_weights: no checkpoint {body.path!r} in this service's run directory")
        if body.model_id is not None:
            model = self._model(body.model_id, "load_weights")
        else:  # create-from-checkpoint: a new model like the checkpoint's, loaded before anything else runs on it
            if body.session_id is None:
                raise HttpReply(400, "load_weights: give model_id, or session_id and model_seq_id")
            model = self._model_like(source, body, self.sessions.get(body.session_id))

        async def work(commands: TrainCommands) -> tuple[bytes, str]:
            loaded = await commands.load_checkpoint(directory, weights_only=not body.optimizer)
            model.steps = loaded.rollout_id
            return (json.dumps({"path": body.path, "model_id": model.model_id, "type": "load_weights"}).encode(),
                    "application/json")

        answer = self._submit(model, body.seq_id if body.model_id is not None else 0, work)
        if body.model_id is None:
            assert self._tasks is not None
            self._tasks.start_soon(model.serve, None)
        return answer

    def _model_like(self, source: Path, body: req.LoadWeights, session: Session) -> TrainingModel:
        try:
            record = json.loads((source / MODEL_RECORD).read_text())
        except (OSError, ValueError) as error:
            raise HttpReply(404, f"load_weights: the checkpoint's model record is unreadable ({error})") from None
        base = self._base(body.base_model or str(record.get("base_model")), "load_weights")
        lora_record = record.get("lora")
        lora = None if lora_record is None else LoraSettings(
            rank=int(lora_record["rank"]), alpha=LORA_ALPHA, target_modules=tuple(lora_record["target_modules"]))
        return self._new_model(session, body.model_seq_id or 0, base, lora, int(record.get("seed") or 0),
                               "load_weights")

    # ---------------------------------------------------------------------------------------------- sampling
    async def _create_sampling_session(self, request: Request) -> Response:
        call = "create_sampling_session"
        body = req.convert(await self._body(request, call), req.CreateSamplingSession, call)
        session = self.sessions.get(body.session_id)
        base_name, weights = self._sampling_target(body.model_path, body.base_model, call)
        sampling_id = f"sampling-{next(self._ids)}"
        self.sampling[sampling_id] = (base_name, weights)
        session.samplers.append(sampling_id)
        return _json({"type": call, "sampling_session_id": sampling_id})

    def _sampling_target(self, model_path: str | None, base_model: str | None, call: str) -> tuple[str, str | None]:
        if model_path is None:
            if base_model is None:
                raise HttpReply(400, f"{call}: give model_path (a sampler checkpoint) or base_model")
            return self._base(base_model, call).name, None
        snapshot = self.sampler_dirs.get(model_path)
        match = _TINKER_PATH.match(model_path)
        if snapshot is None or match is None:
            raise HttpReply(404, f"{call}: no sampler checkpoint {model_path[:200]!r} (save_weights_for_sampler "
                            "answers the paths this service serves)")
        return self.models[match.group(1)].base_name, snapshot

    async def _asample(self, request: Request) -> Response:
        body = req.convert(await self._body(request, "asample"), req.Sample, "asample")
        for name, value in (("topk_prompt_logprobs", body.topk_prompt_logprobs),
                            ("topk_sample_logprobs", body.topk_sample_logprobs),
                            ("target_prompt_logprobs", body.target_prompt_logprobs),
                            ("prompt_alt_tokens_k", body.prompt_alt_tokens_k),
                            ("prompt_logprobs_last_n", body.prompt_logprobs_last_n),
                            ("record_stability_info", body.record_stability_info)):
            if value:
                raise HttpReply(400, f"asample: {name} is not supported by rayless tinker-server")
        if body.sampling_session_id is not None:
            target = self.sampling.get(body.sampling_session_id)
            if target is None:
                raise HttpReply(404, f"asample: unknown sampling_session_id {body.sampling_session_id!r}")
            base_name, weights = target
        else:
            base_name, weights = self._sampling_target(body.model_path, body.base_model, "asample")
        if not 1 <= body.num_samples <= self.bounds.max_samples:
            raise HttpReply(400, f"asample: num_samples must be 1..{self.bounds.max_samples}, got {body.num_samples}")
        base = self.base_models[base_name]
        prompt = req.prompt_tokens(body.prompt, "asample", self.bounds.max_tokens)
        if max(prompt) >= base.vocab_size or min(prompt) < 0:
            raise HttpReply(400, f"asample: the prompt has a token outside the vocabulary (0..{base.vocab_size - 1})")
        params = _engine_params(body.sampling_params)
        sampler = self.samplers.get(base_name)
        if sampler is None:
            assert self._client is not None
            sampler = self.samplers[base_name] = Sampler(name=base_name, path=base.path, run_dir=self.run_dir,
                                                         client=self._client,
                                                         attached_url=self.sampler_urls.get(base_name))
        future = self.futures.create()
        assert self._tasks is not None
        self._tasks.start_soon(self._sample, sampler, future, weights, prompt, body, params)
        return _json({"request_id": future.request_id,
                      "sample_sequence_ids": [f"{future.request_id}-{i}" for i in range(body.num_samples)]})

    async def _sample(self, sampler: Sampler, future: Future, weights: str | None, prompt: list[int],
                      body: req.Sample, params: dict[str, JsonValue]) -> None:
        try:
            data = await sampler.sample(weights=weights, prompt=prompt, num_samples=body.num_samples,
                                        params=params, prompt_logprobs=bool(body.prompt_logprobs))
        except UserError as error:
            FutureStore.fail(future, f"asample: {error}", user=True)
        except EngineError as error:
            FutureStore.fail(future, f"asample: the sampling engine failed: {error}", user=False)
        except Exception as error:  # an engine that would not start, a file gone: this future fails, not the service
            log.exception("asample failed")
            FutureStore.fail(future, f"asample: {type(error).__name__}: {error}", user=False)
        else:
            FutureStore.resolve(future, data, PROTOBUF)


def _engine_params(params: req.SamplingParams) -> dict[str, JsonValue]:
    """Tinker's sampling params as the engine's (SGLang's names)."""
    out: dict[str, JsonValue] = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
    if params.max_tokens is not None:
        out["max_new_tokens"] = params.max_tokens
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    stop = params.stop
    if isinstance(stop, str):
        out["stop"] = [stop]
    elif stop == []:
        out["ignore_eos"] = True  # Tinker: [] disables every stop, EOS included
    elif isinstance(stop, list) and all(isinstance(item, int) for item in stop):
        out["stop_token_ids"] = [item for item in stop if isinstance(item, int)]
    elif isinstance(stop, list) and all(isinstance(item, str) for item in stop):
        out["stop"] = [item for item in stop if isinstance(item, str)]
    elif stop is not None:
        raise HttpReply(400, "asample: sampling_params.stop is a string, a list of strings or a list of token ids")
    return out


def _json(value: JsonValue) -> Response:
    return Response(json.dumps(value), media_type="application/json")


async def _reply(_request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status", None) or getattr(exc, "status_code", 500)
    return Response(json.dumps({"detail": str(exc)}), status_code=status, media_type="application/json")
