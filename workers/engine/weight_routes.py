"""The HTTP face of the engine: SGLang's endpoints over Starlette, served by uvicorn.

Owns request parsing and validation, response shapes (../shared/SGLANG_CONTRACT.md), API-key auth, memory
release/resume, and the weight-update endpoints. Generation itself is the scheduler's; this module only builds
sequences, submits them and renders their state. (Over ~450 lines because it is one route table: every
endpoint is a short handler over the same server state.)

Invariants: every rejected input is a 4xx `{"error": {"message": ...}}` (never a 500 from a TypeError or a
RecursionError), decided before anything joins the running batch, so one client's request cannot break
another's; prompts are tokenized off the event loop; the port opens only after the weights are loaded (as
SGLang); a client that disconnects aborts its sequences, so nothing keeps generating for nobody.

A released engine (`/release_memory_occupation`) answers `/generate` and `/health_generate` with
503 `{"error": {"message": ..., "type": "MemoryReleased", "released": [tags]}}` and counts them (/metrics
`rayless:requests_refused_while_released_total`, /server_info `internal_states[0]`); `/health` stays 200
(the process is alive).

Weight updates follow SGLang 0.5.23: `/init_weights_update_group` forms the group as its
`init_custom_process_group` does (`weight_group`), `/update_weights_from_distributed` must run inside a
session opened by `/begin_weight_update` and closed by `/end_weight_update`, and receives per tensor or as one
flattened bucket. `backend: "nccl"` on an engine whose model is not on CUDA is refused with a 400 (joining with
gloo instead would leave the trainer waiting on a group nobody forms).

Choices where SGLang's behaviour is not worth copying: an unknown sampling key is a 400 naming the key (SGLang
answers a plain-text 500); /metrics is always on.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from workers.engine.args import EngineArgs
from workers.engine.http_input import BodyLimitMiddleware, read_json
from workers.engine.openai_routes import OpenAIRoutes
from workers.engine.runner import ModelRunner, WeightUpdateError
from workers.engine.sampling import RequestError, SamplingParams, parse_sampling_params
from workers.engine.sampling_params import INT64_MAX, show
from workers.engine.scheduler import MEMORY_TAGS, Scheduler
from workers.engine.sequences import MemoryReleasedError, RequestGroup, Seq
from workers.engine.weight_group import (
    WeightGroupError,
    WeightUpdateGroup,
    join_weight_update_group,
    parse_dtype,
    receive,
)
from workers.host_memory import resident_bytes

log = logging.getLogger("rayless.engine")

VERSION = "rayless-cpu-engine 0.1 (SGLang 0.5 HTTP contract)"
HEALTH_TIMEOUT_S = 20.0
GROUP_JOIN_TIMEOUT_S = 300.0


def error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def released_error(exc: MemoryReleasedError) -> JSONResponse:
    """503 that a health monitor can tell from a dead engine: type MemoryReleased and the released tags."""
    body = {"error": {"message": str(exc), "type": "MemoryReleased", "released": exc.released}}
    return JSONResponse(body, status_code=503)


class ApiKeyMiddleware:
    """Bearer auth on every path except /health* and /metrics (as SGLang's --api-key)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if not (path.startswith("/health") or path == "/metrics"):
                header = dict(scope["headers"]).get(b"authorization", b"")
                if not secrets.compare_digest(header, self.expected):
                    await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class EngineServer:
    """Holds the runner, the scheduler and the server-level state; its methods are the route handlers."""

    def __init__(self, args: EngineArgs, runner: ModelRunner) -> None:
        self.args = args
        self.runner = runner
        self.model_path = args.model_path
        self.context_length = args.context_length or int(
            getattr(runner.config, "max_position_embeddings", 0) or 4096
        )
        self.scheduler = Scheduler(
            runner,
            max_running=args.max_running_requests,
            weight_version=args.weight_version,
            seed=args.random_seed,
        )
        self.groups: dict[str, WeightUpdateGroup] = {}
        self.weight_session: str | None = None  # the selector of the open weight-update session
        self.serving = False
        self._probe_ids = runner.tokenizer.encode("1", add_special_tokens=False) or [0]

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # ---- app --------------------------------------------------------------------------------------------

    def app(self) -> ASGIApp:
        get, post, both = ["GET"], ["POST"], ["GET", "POST"]
        routes = [
            Route("/generate", self.generate, methods=both),
            Route("/health", self.health, methods=both),
            Route("/health_generate", self.health_generate, methods=both),
            Route("/model_info", self.model_info, methods=get),
            Route("/get_model_info", self.model_info, methods=get),
            Route("/server_info", self.server_info, methods=get),
            Route("/get_server_info", self.server_info, methods=get),
            Route("/get_weight_version", self.get_weight_version, methods=get),
            Route("/weight_version", self.get_weight_version, methods=get),
            Route("/update_weight_version", self.update_weight_version, methods=post),
            Route("/flush_cache", self.flush_cache, methods=both),
            Route("/abort_request", self.abort_request, methods=post),
            Route("/pause_generation", self.pause_generation, methods=post),
            Route("/continue_generation", self.continue_generation, methods=post),
            Route("/release_memory_occupation", self.release_memory, methods=post),
            Route("/resume_memory_occupation", self.resume_memory, methods=post),
            Route("/metrics", self.metrics, methods=get),
            Route("/update_weights_from_disk", self.update_weights_from_disk, methods=post),
            Route("/init_weights_update_group", self.init_weights_update_group, methods=post),
            Route("/update_weights_from_distributed", self.update_weights_from_distributed, methods=post),
            Route("/destroy_weights_update_group", self.destroy_weights_update_group, methods=post),
            Route("/begin_weight_update", self.begin_weight_update, methods=post),
            Route("/end_weight_update", self.end_weight_update, methods=post),
            *OpenAIRoutes(self).routes(),  # /v1/chat/completions, /v1/completions, /v1/models
        ]
        app: ASGIApp = Starlette(routes=routes, lifespan=self.lifespan)
        app = BodyLimitMiddleware(app, self.args.max_request_bytes)
        if self.args.api_key:
            app = ApiKeyMiddleware(app, self.args.api_key)
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
                for group in self.groups.values():
                    group.close()
                self.runner.stash.discard()
                tg.cancel_scope.cancel()

    # ---- /generate --------------------------------------------------------------------------------------

    async def _json(self, request: Request) -> dict[str, Any]:
        return await read_json(request, self.args.max_request_bytes)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Tokenize (blocking; run in a worker thread). A text whose first `probe` characters already make
        far more tokens than the context holds is refused without tokenizing the rest of it."""
        tokenizer, limit = self.runner.tokenizer, self.context_length
        probe = 8 * limit + 1024
        prompts = []
        for text in texts:
            if len(text) > probe:
                head = len(tokenizer.encode(text[:probe]))
                # The last word of the cut can tokenize differently; 2x the context is beyond any such slack.
                if head > 2 * limit + 16:
                    raise RequestError(
                        f"The input (over {head} tokens) is longer than the model's context length "
                        f"({limit} tokens)."
                    )
            prompts.append(tokenizer.encode(text))
        return prompts

    async def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise RequestError("give exactly one of 'text' or 'input_ids'")
        if text is not None:
            if isinstance(text, str):
                texts, batched = [text], False
            elif isinstance(text, list) and all(isinstance(t, str) for t in text):
                texts, batched = text, True
            else:
                raise RequestError("'text' must be a string or a list of strings")
            if not texts or any(not t for t in texts):
                raise RequestError("the input is empty")
            self._check_count(len(texts), 1)
            # Off the event loop: a 5 MB prompt takes seconds to tokenize, and /health must answer meanwhile.
            prompts = await anyio.to_thread.run_sync(self._encode, texts)
        else:
            if isinstance(input_ids, list) and input_ids and all(isinstance(i, list) for i in input_ids):
                prompts, batched = input_ids, True
            elif isinstance(input_ids, list):
                prompts, batched = [input_ids], False
            else:
                raise RequestError("'input_ids' must be a list of ints or a list of lists of ints")
            self._check_count(len(prompts), 1)
            if sum(len(ids) for ids in prompts) > 100_000:  # a long list takes a while to check: off the loop
                await anyio.to_thread.run_sync(self._check_ids, prompts)
            else:
                self._check_ids(prompts)
        if not prompts or any(len(ids) == 0 for ids in prompts):
            raise RequestError("the input is empty")
        for ids in prompts:
            if len(ids) >= self.context_length:
                raise RequestError(
                    f"The input ({len(ids)} tokens) is longer than the model's context length "
                    f"({self.context_length} tokens)."
                )
        return [list(ids) for ids in prompts], batched

    def _check_ids(self, prompts: list[Any]) -> None:
        vocab = self.runner.vocab_size
        for ids in prompts:
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise RequestError("'input_ids' must contain integers only")
            if any(not 0 <= i < vocab for i in ids):
                raise RequestError(f"'input_ids' has ids outside the vocabulary [0, {vocab})")

    def _check_count(self, prompts: int, n: int) -> None:
        limit = self.args.max_seqs_per_request
        if prompts * n > limit:
            raise RequestError(
                f"the request makes {prompts} prompt(s) x n={n} = {prompts * n} sequences, over the engine's "
                f"--max-seqs-per-request ({limit})"
            )

    @staticmethod
    def _per_item(value: Any, count: int, name: str) -> list[Any]:
        if isinstance(value, list):
            if len(value) != count:
                raise RequestError(f"'{name}' has {len(value)} entries for {count} prompts")
            return value
        return [value] * count

    @staticmethod
    def _flag(body: dict[str, Any], key: str) -> bool:
        value = body.get(key)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise RequestError(f"'{key}' must be true or false, got {show(value)}")
        return value

    def _int_field(self, value: Any, name: str, low: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= INT64_MAX:
            raise RequestError(f"{name} must be an integer in [{low}, 2**63 - 1], got {show(value)}")
        return value

    async def build(self, body: dict[str, Any]) -> tuple[list[Seq], bool, Any]:
        """Validate the whole request and make its sequences; nothing reaches the scheduler before this
        returns, so a bad request is refused whole and never joins (or breaks) the running batch."""
        if body.get("lora_path") is not None:
            raise RequestError("'lora_path': LoRA adapters are not supported by the rayless engine")
        stream = self._flag(body, "stream")
        self._flag(body, "return_text_in_logprobs")
        prompts, batched = await self._prompts(body)
        count = len(prompts)
        params_list = [
            parse_sampling_params(p, vocab_size=self.runner.vocab_size, max_n=self.args.max_n)
            for p in self._per_item(body.get("sampling_params"), count, "sampling_params")
        ]
        total_seqs = sum(params.n for params in params_list)
        if total_seqs > self.args.max_seqs_per_request:
            self._check_count(count, max(params.n for params in params_list))
        rids = self._per_item(body.get("rid"), count, "rid")
        return_logprob = self._per_item(body.get("return_logprob", False), count, "return_logprob")
        start_lens = self._per_item(body.get("logprob_start_len", -1), count, "logprob_start_len")
        top_nums = self._per_item(body.get("top_logprobs_num", 0), count, "top_logprobs_num")
        group = RequestGroup(stream=stream)
        seqs: list[Seq] = []
        for index, (ids, params) in enumerate(zip(prompts, params_list, strict=True)):
            left = self.context_length - len(ids)
            max_new = left if params.max_new_tokens is None else params.max_new_tokens
            if max_new > left:
                total = len(ids) + max_new
                raise RequestError(
                    f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                    f"tokens. You requested a total of {total} tokens: {len(ids)} tokens from the input messages "
                    f"and {max_new} tokens for the completion. Please reduce the number of tokens "
                    "in the input messages or the completion to fit within the limit."
                )
            start = self._int_field(start_lens[index], "logprob_start_len", -1)
            start = len(ids) - 1 if start == -1 else min(start, len(ids) - 1)
            top_num = self._int_field(top_nums[index] or 0, "top_logprobs_num", 0)
            top_num = min(top_num, self.runner.vocab_size)
            wants_logprob = return_logprob[index]
            if wants_logprob is not None and not isinstance(wants_logprob, bool):
                raise RequestError(f"'return_logprob' must be true or false, got {show(wants_logprob)}")
            rid = rids[index]
            if rid is not None and not isinstance(rid, str):
                raise RequestError("'rid' must be a string or a list of strings")
            for sample in range(params.n):
                public_id = rid if rid is not None and params.n == 1 else uuid.uuid4().hex
                seqs.append(
                    Seq(
                        public_id=public_id,
                        rid=rid,
                        prompt_ids=ids,
                        params=params,
                        generator=self.scheduler.new_generator(params.sampling_seed, sample),
                        group=group,
                        index=len(seqs),
                        return_logprob=bool(wants_logprob),
                        logprob_start=start,
                        top_logprobs_num=top_num,
                        max_new_tokens=max_new,
                        weight_version=self.weight_version,
                    )
                )
        group.seqs = seqs
        single = not batched and len(seqs) == 1
        return seqs, single, group

    def _token_text(self, token: int, with_text: bool) -> str | None:
        return self.runner.tokenizer.decode([token]) if with_text else None

    def render(self, seq: Seq, *, with_text: bool, final: bool) -> dict[str, Any]:
        scheduler = self.scheduler
        if final or seq.finished:
            text = scheduler.text_of(seq)
        else:
            text = self.runner.tokenizer.decode(
                seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens
            )
        meta: dict[str, Any] = {
            "id": seq.public_id,
            "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": 0,
            "weight_version": seq.weight_version if seq.finished else self.weight_version,
            "e2e_latency": seq.latency
            if seq.latency is not None
            else time.perf_counter() - seq.group.created,
        }
        if seq.return_logprob:
            meta["input_token_logprobs"] = [
                [lp, token, self._token_text(token, with_text)] for lp, token in (seq.input_logprobs or [])
            ]
            meta["output_token_logprobs"] = [
                [lp, token, self._token_text(token, with_text)]
                for lp, token in zip(seq.output_logprobs, seq.output_ids, strict=True)
            ]
            if seq.top_logprobs_num:
                meta["input_top_logprobs"] = [
                    [[lp, t, self._token_text(t, with_text)] for lp, t in entry]
                    for entry in (seq.input_top_logprobs or [])
                ]
                meta["output_top_logprobs"] = [
                    [[lp, t, self._token_text(t, with_text)] for lp, t in entry]
                    for entry in seq.output_top_logprobs
                ]
        return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}

    async def generate(self, request: Request) -> Response:
        try:
            body = await self._json(request)
            seqs, single, group = await self.build(body)
            await self.scheduler.submit(group)
        except RequestError as exc:
            return error(str(exc))
        except MemoryReleasedError as exc:
            return released_error(exc)
        with_text = bool(body.get("return_text_in_logprobs", False))
        if group.stream:
            return StreamingResponse(
                self._stream(group, seqs, single=single, with_text=with_text), media_type="text/event-stream"
            )
        await self.wait_or_disconnect(request, group)
        rendered = [self.render(seq, with_text=with_text, final=True) for seq in seqs]
        return JSONResponse(rendered[0] if single else rendered)

    async def wait_or_disconnect(self, request: Request, group: Any) -> None:
        """Wait for the group; if the client goes away first, abort its sequences."""

        async def watch_disconnect() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    self.scheduler.abort_group(group, "client disconnected")
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect)
            await group.wait_finished()
            tg.cancel_scope.cancel()

    async def _stream(
        self, group: Any, seqs: list[Seq], *, single: bool, with_text: bool
    ) -> AsyncIterator[str]:
        sent: dict[int, tuple[int, bool]] = {}
        try:
            while True:
                group.changed = anyio.Event()
                for seq in seqs:
                    state = (len(seq.output_ids), seq.finished)
                    if sent.get(seq.index, (0, False)) == state:
                        continue  # nothing new (SGLang sends no chunk before the first token)
                    interval = seq.params.stream_interval
                    if interval and not seq.finished and state[0] % interval:
                        continue  # stream_interval: a chunk every `interval` tokens, and the last one
                    sent[seq.index] = state
                    chunk = self.render(seq, with_text=with_text, final=seq.finished)
                    if not single:
                        chunk["index"] = seq.index
                    yield f"data: {json.dumps(chunk)}\n\n"
                if group.finished:
                    break
                await group.changed.wait()
            yield "data: [DONE]\n\n"
        finally:
            # Reached with sequences still running only when the client went away mid-stream.
            self.scheduler.abort_group(group, "client disconnected")

    # ---- health and info ------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.serving else 503)

    async def health_generate(self, request: Request) -> Response:
        if not self.serving:
            return error("the engine is starting or shutting down", 503)
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        group = RequestGroup()
        seq = Seq(
            public_id=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            rid=None,
            prompt_ids=list(self._probe_ids),
            params=params,
            generator=torch.Generator(),
            group=group,
            index=0,
        )
        group.seqs = [seq]
        with anyio.move_on_after(HEALTH_TIMEOUT_S):
            try:
                await self.scheduler.submit(group, bypass=True)
            except MemoryReleasedError as exc:
                return released_error(exc)
            await group.wait_finished()
        if not seq.finished or (seq.finish_reason or {}).get("type") == "abort":
            self.scheduler.abort_group(group, "health check timed out")
            if self.scheduler.released:  # released while the probe waited: alive, say so
                return released_error(MemoryReleasedError(self.scheduler.released))
            return error("health check generation did not finish", 503)
        return Response(status_code=200)

    def _model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.args.tokenizer_path,
            "is_generation": True,
            "weight_version": self.weight_version,
            "preferred_sampling_params": None,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.runner.config, "model_type", None),
            "architectures": getattr(self.runner.config, "architectures", None),
        }

    async def model_info(self, request: Request) -> Response:
        return JSONResponse(self._model_info())

    async def server_info(self, request: Request) -> Response:
        info: dict[str, Any] = {k: v for k, v in vars(self.args).items() if k != "api_key"}
        info.update(
            model_path=self.model_path,
            context_length=self.context_length,
            tp_size=1,
            dp_size=1,
            weight_version=self.weight_version,
            max_total_num_tokens=self.context_length * self.args.max_running_requests,
            version=VERSION,
            device=self.runner.device.type,
            internal_states=[
                {
                    "last_gen_throughput": self.scheduler.gen_throughput(),
                    "num_running_reqs": len(self.scheduler.running),
                    "num_queue_reqs": len(self.scheduler.waiting),
                    "paused": self.scheduler.paused,
                    # Released memory (SGLang tags); while non-empty /generate and /health_generate are 503
                    # MemoryReleased and counted below.
                    "memory_released": sorted(self.scheduler.released),
                    "released": sorted(self.scheduler.released),
                    "requests_refused_while_released": self.scheduler.refused_while_released,
                    "health_probes_while_released": self.scheduler.probes_while_released,
                    **self._memory_figures(),
                }
            ],
        )
        return JSONResponse(info)

    def _memory_figures(self) -> dict[str, Any]:
        figures: dict[str, Any] = {
            "device": str(self.runner.device),
            "rss_bytes": resident_bytes(),
            "weight_bytes_resident": self.runner.stash.parameter_bytes(),
            "kv_cache_tokens": self.runner.cached_tokens(),
        }
        if self.runner.device.type == "cuda":
            figures["cuda_memory_allocated"] = torch.cuda.memory_allocated(self.runner.device)
            figures["cuda_memory_reserved"] = torch.cuda.memory_reserved(self.runner.device)
            figures["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.runner.device)
        return figures

    async def get_weight_version(self, request: Request) -> Response:
        return JSONResponse({"weight_version": self.weight_version})

    async def metrics(self, request: Request) -> Response:
        s = self.scheduler
        labels = f'{{model_name="{self.model_path}"}}'
        lines = []
        for name, kind, value, help_text in [
            ("num_running_reqs", "gauge", len(s.running), "running requests"),
            ("num_queue_reqs", "gauge", len(s.waiting), "requests waiting to run"),
            ("gen_throughput", "gauge", s.gen_throughput(), "generated tokens per second (last 5 s)"),
            ("num_used_tokens", "gauge", self.runner.cached_tokens(), "tokens in the KV cache"),
            ("prompt_tokens_total", "counter", s.prompt_tokens_total, "prefilled prompt tokens"),
            ("generation_tokens_total", "counter", s.generation_tokens_total, "generated tokens"),
            ("num_requests_total", "counter", s.requests_total, "generate requests"),
            (
                "rayless:requests_refused_while_released_total",
                "counter",
                s.refused_while_released,
                "generate requests refused because memory was released",
            ),
            ("rayless:memory_released", "gauge", len(s.released), "released memory tags (0: none)"),
            (
                "rayless:weight_bytes_resident",
                "gauge",
                self.runner.stash.parameter_bytes(),
                "bytes the weights hold on the device",
            ),
        ]:
            full = name if ":" in name else f"sglang:{name}"
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
            lines.append(f"{full}{labels} {float(value)}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # ---- control ----------------------------------------------------------------------------------------

    async def _handle(
        self, request: Request, action: Callable[[dict[str, Any]], Awaitable[Response]]
    ) -> Response:
        try:
            return await action(await self._json(request))
        except RequestError as exc:
            return error(str(exc))

    async def update_weight_version(self, request: Request) -> Response:
        async def action(body: dict[str, Any]) -> Response:
            new_version = body.get("new_version")
            if not isinstance(new_version, str) or not new_version:
                raise RequestError("'new_version' must be a non-empty string")
            if body.get("abort_all_requests", True):
                self.scheduler.abort(abort_all=True, message="Abort by update_weight_version")
            self.scheduler.weight_version = new_version
            return JSONResponse(
                {
                    "success": True,
                    "message": f"Weight version updated to {new_version}",
                    "new_version": new_version,
                }
            )

        return await self._handle(request, action)

    async def flush_cache(self, request: Request) -> Response:
        if await self.scheduler.flush():
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse("Cache not flushed because there are running or waiting requests.\n", 400)

    async def abort_request(self, request: Request) -> Response:
        async def action(body: dict[str, Any]) -> Response:
            rid = body.get("rid")
            if rid is not None and not isinstance(rid, str):
                raise RequestError("'rid' must be a string")
            count = self.scheduler.abort(rid=rid, abort_all=bool(body.get("abort_all", False)))
            return JSONResponse({"success": True, "num_aborted": count})

        return await self._handle(request, action)

    async def pause_generation(self, request: Request) -> Response:
        async def action(body: dict[str, Any]) -> Response:
            await self.scheduler.pause(str(body.get("mode", "abort")))
            return JSONResponse({"success": True, "message": "Generation paused successfully."})

        return await self._handle(request, action)

    async def continue_generation(self, request: Request) -> Response:
        self.scheduler.resume()
        return JSONResponse({"success": True, "message": "Generation continued successfully."})

    @staticmethod
    def _tags(body: dict[str, Any]) -> set[str]:
        tags = body.get("tags")
        if tags is None or tags == []:  # SGLang: null or empty means every tag
            return set(MEMORY_TAGS)
        if not isinstance(tags, list) or not all(isinstance(t, str) and t in MEMORY_TAGS for t in tags):
            raise RequestError(f"'tags' must be null or a list drawn from {list(MEMORY_TAGS)}, got {show(tags)}")
        return set(tags)

    async def release_memory(self, request: Request) -> Response:
        async def action(body: dict[str, Any]) -> Response:
            tags = self._tags(body)
            try:
                freed = await self.scheduler.release(tags)
            except OSError as exc:  # the CPU spill file could not be written: nothing was freed
                return error(f"release_memory_occupation failed, nothing released: {exc}", 500)
            log.info("released memory %s (%s)", sorted(tags), freed)
            return JSONResponse({"success": True, "message": f"released {sorted(tags)}", **freed})

        return await self._handle(request, action)

    async def resume_memory(self, request: Request) -> Response:
        async def action(body: dict[str, Any]) -> Response:
            tags = self._tags(body)
            try:
                await self.scheduler.resume_memory(tags)
            except OSError as exc:
                return error(f"resume_memory_occupation failed: {exc}", 500)
            log.info("resumed memory %s", sorted(tags))
            return JSONResponse({"success": True, "message": f"resumed {sorted(tags)}"})

        return await self._handle(request, action)

    # ---- weight updates --------------------------------------------------------------------------------

    @staticmethod
    def _weights_result(success: bool, message: str) -> JSONResponse:
        return JSONResponse(
            {"success": success, "message": message, "num_paused_requests": 0},
            status_code=200 if success else 400,
        )

    def _finish_update(self, body: dict[str, Any]) -> None:
        version = body.get("weight_version")
        if version is not None:
            self.scheduler.weight_version = str(version)

    async def update_weights_from_disk(self, request: Request) -> Response:
        try:
            body = await self._json(request)
        except RequestError as exc:
            return self._weights_result(False, str(exc))
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            return self._weights_result(False, "'model_path' must be a non-empty string")
        if body.get("abort_all_requests", False):
            self.scheduler.abort(abort_all=True, message="Abort by update_weights_from_disk")
        async with self.scheduler.exclusive_update():
            try:
                count = await anyio.to_thread.run_sync(self.runner.load_from_disk, model_path)
            except WeightUpdateError as exc:
                log.warning("update_weights_from_disk(%s) rejected: %s", model_path, exc)
                return self._weights_result(False, str(exc))
            if body.get("flush_cache", True) and not self.scheduler.running:
                await anyio.to_thread.run_sync(self.runner.reset)
            self.model_path = model_path
            self._finish_update(body)
        log.info("loaded %d tensors from %s (weight_version %s)", count, model_path, self.weight_version)
        return self._weights_result(True, f"Succeeded to update model weights ({count} tensors).")

    def _model_device(self) -> torch.device:
        return next(self.runner.model.parameters()).device

    async def init_weights_update_group(self, request: Request) -> Response:
        try:
            body = await self._json(request)
            address = body.get("master_address")
            port, rank_offset, world_size = (
                body.get("master_port"),
                body.get("rank_offset"),
                body.get("world_size"),
            )
            group_name = str(body.get("group_name") or "weight_update_group")
            backend = str(body.get("backend") or "nccl")
            if not isinstance(address, str) or not address:
                raise RequestError("'master_address' must be a host name or address")
            if not all(
                isinstance(v, int) and not isinstance(v, bool) for v in (port, rank_offset, world_size)
            ):
                raise RequestError("'master_port', 'rank_offset' and 'world_size' must be integers")
            if not 0 < port < 2**16:
                raise RequestError(f"'master_port' {port} is outside 1-65535")
            if not 0 < rank_offset < world_size:  # this engine's one tp rank: rank_offset + 0
                raise RequestError(f"rank_offset {rank_offset} must be in [1, world_size={world_size})")
            if group_name in self.groups:
                raise RequestError(f"weight update group {group_name!r} already exists; destroy it first")
            if backend not in ("gloo", "nccl"):
                raise RequestError(f"backend {backend!r} is not supported: use 'gloo' or 'nccl'")
            if backend == "nccl" and self._model_device().type != "cuda":
                raise RequestError(
                    f"backend 'nccl' needs CUDA tensors but this engine's model is on {self._model_device()}: "
                    "form the group with backend 'gloo'"
                )
        except RequestError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        join = partial(
            join_weight_update_group,
            master_address=address,
            master_port=port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=GROUP_JOIN_TIMEOUT_S,
        )
        try:
            # Blocks until the trainer's rank 0 (and every other engine) joins: off the event loop.
            self.groups[group_name] = await anyio.to_thread.run_sync(join)
        except (WeightGroupError, ValueError) as exc:
            return JSONResponse({"success": False, "message": f"Failed to initialize custom process group: {exc}."}, 400)
        return JSONResponse(
            {
                "success": True,
                "message": f"Succeeded to initialize custom process group {group_name!r} as rank {rank_offset} "
                f"of {world_size} ({backend}).",
            }
        )

    async def begin_weight_update(self, request: Request) -> Response:
        """Open the weight-update session `/update_weights_from_distributed` needs (SGLang 0.5.21+)."""
        try:
            selector = (await self._json(request)).get("selector", "all")
            if selector not in ("all", "target", "draft"):
                raise RequestError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
        except RequestError as exc:
            return self._session_result(False, str(exc))
        if self.weight_session is not None:
            return self._session_result(
                False, "a weight-update session is already open; call end_weight_update() first"
            )
        self.weight_session = selector
        return self._session_result(True, "Success")

    async def end_weight_update(self, request: Request) -> Response:
        if self.weight_session is None:
            return self._session_result(
                False, "no weight-update session is open; call begin_weight_update() first"
            )
        self.weight_session = None
        return self._session_result(True, "Success")

    @staticmethod
    def _session_result(success: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    def _distributed_request(self, body: dict[str, Any]) -> tuple[WeightUpdateGroup, list[torch.dtype]]:
        """The group and dtypes of a valid `/update_weights_from_distributed` body; RequestError otherwise."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        group_name = str(body.get("group_name") or "weight_update_group")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise RequestError("'names', 'dtypes' and 'shapes' must be lists")
        if not len(names) == len(dtypes) == len(shapes) or not names:
            raise RequestError("'names', 'dtypes' and 'shapes' must be non-empty and of equal length")
        try:
            torch_dtypes = [parse_dtype(d) for d in dtypes]
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        if not all(isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes):
            raise RequestError("each of 'shapes' must be a list of non-negative integers")
        if body.get("selector", "all") not in ("all", "target", "draft"):
            raise RequestError(f"invalid selector {body.get('selector')!r}; expected 'target', 'draft', or 'all'")
        if self.weight_session is None:
            raise RequestError(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        group = self.groups.get(group_name)
        if group is None:
            raise RequestError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        return group, torch_dtypes

    async def update_weights_from_distributed(self, request: Request) -> Response:
        try:
            body = await self._json(request)
            group, torch_dtypes = self._distributed_request(body)
        except RequestError as exc:
            return self._weights_result(False, str(exc))
        names, shapes = body["names"], body["shapes"]
        if body.get("abort_all_requests", False):
            self.scheduler.abort(abort_all=True, message="Abort by update_weights_from_distributed")
        device = self._model_device() if group.backend == "nccl" else torch.device("cpu")
        receive_one = partial(
            receive, group, names, torch_dtypes, shapes, load_format=body.get("load_format"), device=device
        )
        async with self.scheduler.exclusive_update():
            try:
                # Receive every announced tensor even when the names turn out to be wrong: the trainer's
                # broadcasts must all be matched or rank 0 would block.
                tensors = await anyio.to_thread.run_sync(receive_one)
            except (RuntimeError, ValueError) as exc:
                return self._weights_result(False, f"Failed to receive weights: {exc}")
            try:
                count = await anyio.to_thread.run_sync(
                    partial(self.runner.load_tensors, dict(tensors), require_all=False)
                )
            except WeightUpdateError as exc:
                return self._weights_result(False, str(exc))
            if body.get("flush_cache", True) and not self.scheduler.running:
                await anyio.to_thread.run_sync(self.runner.reset)
            self._finish_update(body)
        return self._weights_result(True, f"Succeeded to update model weights ({count} tensors).")

    async def destroy_weights_update_group(self, request: Request) -> Response:
        try:
            body = await self._json(request)
        except RequestError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, 400)
        group_name = str(body.get("group_name") or "weight_update_group")
        group = self.groups.pop(group_name, None)
        if group is None:
            return JSONResponse({"success": False, "message": "The group to be destroyed does not exist."}, 400)
        await anyio.to_thread.run_sync(group.close)
        return JSONResponse({"success": True, "message": "Succeeded to destroy custom process group."})


def _configure_threads() -> None:
    threads = int(os.environ.get("RAYLESS_ENGINE_THREADS", "1"))
    torch.set_num_threads(max(1, threads))


def serve(args: EngineArgs) -> int:
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    _configure_threads()
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    started = time.perf_counter()
    # The first line of the log: the launcher reads "the engine writes its log" as "it is loading".
    log.info("loading the model from %s on %s (%s)", args.model_path, args.device, args.dtype)
    try:
        runner = ModelRunner(
            args.model_path,
            tokenizer_path=args.tokenizer_path,
            dtype=args.dtype,
            device=args.device,
            weight_spill_dir=args.weight_spill_dir,
        )
    except (OSError, ValueError) as exc:  # FileNotFoundError included: a bad --model-path is the usual cause
        log.error("cannot load the model from %s: %s", args.model_path, exc)
        return 2
    server = EngineServer(args, runner)
    if not args.skip_server_warmup:
        # One forward before the port opens, so the first request does not pay for lazy initialisation.
        with torch.inference_mode():
            runner.model(input_ids=torch.tensor([server._probe_ids], device=runner.device))
    log.info(
        "model loaded from %s on %s (%s) in %.1f s",
        args.model_path,
        runner.device,
        next(runner.model.parameters()).dtype,
        time.perf_counter() - started,
    )
    config = uvicorn.Config(
        server.app(),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    anyio.run(uvicorn.Server(config).serve)
    return 0
