"""The engine's health, info and metrics endpoints: `/health`, `/health_generate`, `/model_info`,
`/server_info`, `/get_weight_version`, `/metrics` (with SGLang's aliases).

Owns their shapes. `/health` is 200 while the app serves (the process is alive, released or not);
`/health_generate` runs a one-token probe that never joins the batch and is 503 if it does not finish in
`HEALTH_TIMEOUT_S`. A released engine (`/release_memory_occupation`) answers the probe with 503
`{"error": {"message": ..., "type": "MemoryReleased", "released": [tags]}}` and counts it; its refused requests
show in /metrics (`rayless:requests_refused_while_released_total`) and /server_info (`internal_states[0]`).
/metrics is always on (SGLang needs `--enable-metrics`).

Invariant: these endpoints only read the engine's state (the probe aside, which is a generation of its own).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from workers.boundary.json_input import JsonObject
from workers.engine.replies import error, released_error
from workers.engine.sampling import SamplingParams
from workers.engine.sequences import MemoryReleasedError, RequestGroup, Seq
from workers.host_memory import resident_bytes

if TYPE_CHECKING:
    from workers.engine.args import EngineArgs
    from workers.engine.runner import ModelRunner
    from workers.engine.scheduler import Scheduler

VERSION = "rayless-cpu-engine 0.1 (SGLang 0.5 HTTP contract)"
HEALTH_TIMEOUT_S = 20.0
SECRET_ARGS = frozenset({"api_key", "admin_api_key"})  # never in /server_info


class InfoCore(Protocol):
    """What the info routes read of the engine (`workers.engine.server.EngineServer`)."""

    args: EngineArgs
    runner: ModelRunner
    scheduler: Scheduler
    model_path: str
    context_length: int
    serving: bool
    probe_ids: list[int]

    @property
    def weight_version(self) -> str: ...


class InfoRoutes:
    """Health, info and metrics handlers over one engine."""

    def __init__(self, server: InfoCore) -> None:
        self.server = server

    def routes(self) -> list[Route]:
        get, both = ["GET"], ["GET", "POST"]
        return [
            Route("/health", self.health, methods=both),
            Route("/health_generate", self.health_generate, methods=both),
            Route("/model_info", self.model_info, methods=get),
            Route("/get_model_info", self.model_info, methods=get),
            Route("/server_info", self.server_info, methods=get),
            Route("/get_server_info", self.server_info, methods=get),
            Route("/get_weight_version", self.get_weight_version, methods=get),
            Route("/weight_version", self.get_weight_version, methods=get),
            Route("/metrics", self.metrics, methods=get),
        ]

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.server.serving else 503)

    async def health_generate(self, request: Request) -> Response:
        scheduler = self.server.scheduler
        if not self.server.serving:
            return error("the engine is starting or shutting down", 503)
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        group = RequestGroup()
        seq = Seq(
            public_id=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            rid=None,
            prompt_ids=list(self.server.probe_ids),
            params=params,
            generator=torch.Generator(),
            group=group,
            index=0,
        )
        group.seqs = [seq]
        with anyio.move_on_after(HEALTH_TIMEOUT_S):
            try:
                await scheduler.submit(group, bypass=True)
            except MemoryReleasedError as exc:
                return released_error(exc)
            await group.wait_finished()
        if not seq.finished or (seq.finish_reason or {}).get("type") == "abort":
            scheduler.abort_group(group, "health check timed out")
            if scheduler.released:  # released while the probe waited: alive, say so
                return released_error(MemoryReleasedError(scheduler.released))
            return error("health check generation did not finish", 503)
        return Response(status_code=200)

    def _model_info(self) -> JsonObject:
        return {
            "model_path": self.server.model_path,
            "tokenizer_path": self.server.args.tokenizer_path,
            "is_generation": True,
            "weight_version": self.server.weight_version,
            "preferred_sampling_params": None,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.server.runner.config, "model_type", None),
            "architectures": getattr(self.server.runner.config, "architectures", None),
        }

    async def model_info(self, request: Request) -> Response:
        return JSONResponse(self._model_info())

    async def server_info(self, request: Request) -> Response:
        server = self.server
        scheduler = server.scheduler
        info: dict[str, Any] = {k: v for k, v in vars(server.args).items() if k not in SECRET_ARGS}
        info.update(
            model_path=server.model_path,
            context_length=server.context_length,
            tp_size=1,
            dp_size=1,
            weight_version=server.weight_version,
            max_total_num_tokens=server.context_length * server.args.max_running_requests,
            version=VERSION,
            device=server.runner.device.type,
            internal_states=[
                {
                    "last_gen_throughput": scheduler.gen_throughput(),
                    "num_running_reqs": len(scheduler.running),
                    "num_queue_reqs": len(scheduler.waiting),
                    "paused": scheduler.paused,
                    # Released memory (SGLang tags); while non-empty /generate and /health_generate are 503
                    # MemoryReleased and counted below.
                    "memory_released": sorted(scheduler.released),
                    "released": sorted(scheduler.released),
                    "requests_refused_while_released": scheduler.refused_while_released,
                    "health_probes_while_released": scheduler.probes_while_released,
                    **self._memory_figures(),
                }
            ],
        )
        return JSONResponse(info)

    def _memory_figures(self) -> JsonObject:
        runner = self.server.runner
        figures: dict[str, Any] = {
            "device": str(runner.device),
            "rss_bytes": resident_bytes(),
            "weight_bytes_resident": runner.stash.parameter_bytes(),
            "kv_cache_tokens": runner.cached_tokens(),
        }
        if runner.device.type == "cuda":
            figures["cuda_memory_allocated"] = torch.cuda.memory_allocated(runner.device)
            figures["cuda_memory_reserved"] = torch.cuda.memory_reserved(runner.device)
            figures["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(runner.device)
        return figures

    async def get_weight_version(self, request: Request) -> Response:
        return JSONResponse({"weight_version": self.server.weight_version})

    async def metrics(self, request: Request) -> Response:
        s = self.server.scheduler
        labels = f'{{model_name="{self.server.model_path}"}}'
        lines = []
        for name, kind, value, help_text in [
            ("num_running_reqs", "gauge", len(s.running), "running requests"),
            ("num_queue_reqs", "gauge", len(s.waiting), "requests waiting to run"),
            ("gen_throughput", "gauge", s.gen_throughput(), "generated tokens per second (last 5 s)"),
            ("num_used_tokens", "gauge", self.server.runner.cached_tokens(), "tokens in the KV cache"),
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
                self.server.runner.stash.parameter_bytes(),
                "bytes the weights hold on the device",
            ),
        ]:
            full = name if ":" in name else f"sglang:{name}"
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
            lines.append(f"{full}{labels} {float(value)}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")
