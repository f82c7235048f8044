"""Weight updates: from disk, over a weight-update group, and the weight version, as SGLang 0.5.23 serves them.

Owns the handlers and the engine's weight-update groups and session. `/init_weights_update_group` forms a
group as SGLang's `init_custom_process_group` does (`weight_group`); `/update_weights_from_distributed` must
run inside a session opened by `/begin_weight_update` and closed by `/end_weight_update`, and receives per
tensor or as one flattened bucket. `backend: "nccl"` on an engine whose model is not on CUDA is refused with a
400 (joining with gloo instead would leave the trainer waiting on a group nobody forms).

Invariants: an update waits for in-flight requests (unless paused or `abort_all_requests`) and holds new ones,
then owns the model (`Scheduler.exclusive_update`), so no forward pass sees half-loaded weights; every tensor
the trainer announces is received even when its name is wrong, so the trainer's broadcasts never block.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Protocol

import anyio
import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workers.boundary.json_input import JsonObject
from workers.engine.http_input import read_json
from workers.engine.replies import handle
from workers.engine.runner import WeightUpdateError
from workers.engine.sampling import RequestError
from workers.shared_torch.weight_delta import LOAD_FORMAT as DELTA_LOAD_FORMAT
from workers.shared_torch.weight_group import (
    WeightGroupError,
    WeightUpdateGroup,
    join_weight_update_group,
    parse_dtype,
    receive,
)

if TYPE_CHECKING:
    from workers.engine.args import EngineArgs
    from workers.engine.runner import ModelRunner
    from workers.engine.scheduler import Scheduler

log = logging.getLogger("rayless.engine")

GROUP_JOIN_TIMEOUT_S = 300.0


class WeightCore(Protocol):
    """What the weight routes use of the engine (`workers.engine.server.EngineServer`); they set
    `model_path`."""

    args: EngineArgs
    runner: ModelRunner
    scheduler: Scheduler
    model_path: str

    @property
    def weight_version(self) -> str: ...


class WeightRoutes:
    """Weight-update handlers over one engine, and the weight-update groups it has joined."""

    def __init__(self, server: WeightCore) -> None:
        self.server = server
        self.groups: dict[str, WeightUpdateGroup] = {}
        self.weight_session: str | None = None  # the selector of the open weight-update session

    def routes(self) -> list[Route]:
        post = ["POST"]
        return [
            Route("/update_weight_version", self.update_weight_version, methods=post),
            Route("/update_weights_from_disk", self.update_weights_from_disk, methods=post),
            Route("/get_weights_by_name", self.get_weights_by_name, methods=["GET", "POST"]),
            Route("/init_weights_update_group", self.init_weights_update_group, methods=post),
            Route("/update_weights_from_distributed", self.update_weights_from_distributed, methods=post),
            Route("/destroy_weights_update_group", self.destroy_weights_update_group, methods=post),
            Route("/begin_weight_update", self.begin_weight_update, methods=post),
            Route("/end_weight_update", self.end_weight_update, methods=post),
        ]

    def close(self) -> None:
        """Leave every group (at shutdown)."""
        for group in self.groups.values():
            group.close()

    async def _json(self, request: Request) -> JsonObject:
        return await read_json(request, self.server.args.max_request_bytes)

    async def update_weight_version(self, request: Request) -> Response:
        async def action(body: JsonObject) -> Response:
            new_version = body.get("new_version")
            if not isinstance(new_version, str) or not new_version:
                raise RequestError("'new_version' must be a non-empty string")
            if body.get("abort_all_requests", True):
                self.server.scheduler.abort(abort_all=True, message="Abort by update_weight_version")
            self.server.scheduler.weight_version = new_version
            return JSONResponse(
                {
                    "success": True,
                    "message": f"Weight version updated to {new_version}",
                    "new_version": new_version,
                }
            )

        return await handle(request, self.server.args.max_request_bytes, action)

    @staticmethod
    def _weights_result(success: bool, message: str) -> JSONResponse:
        return JSONResponse(
            {"success": success, "message": message, "num_paused_requests": 0},
            status_code=200 if success else 400,
        )

    def _finish_update(self, body: JsonObject) -> None:
        version = body.get("weight_version")
        if version is not None:
            self.server.scheduler.weight_version = str(version)

    async def update_weights_from_disk(self, request: Request) -> Response:
        try:
            body = await self._json(request)
        except RequestError as exc:
            return self._weights_result(False, str(exc))
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            return self._weights_result(False, "'model_path' must be a non-empty string")
        if body.get("abort_all_requests", False):
            self.server.scheduler.abort(abort_all=True, message="Abort by update_weights_from_disk")
        delta = body.get("load_format") == DELTA_LOAD_FORMAT
        async with self.server.scheduler.exclusive_update():
            try:
                if delta:  # a delta applies to the weights held now, named by their version
                    load = partial(self.server.runner.load_delta, model_path, self.server.weight_version)
                else:
                    load = partial(self.server.runner.load_from_disk, model_path)
                count = await anyio.to_thread.run_sync(load)
            except WeightUpdateError as exc:
                log.warning("update_weights_from_disk(%s) rejected: %s", model_path, exc)
                return self._weights_result(False, str(exc))
            if body.get("flush_cache", True) and not self.server.scheduler.running:
                await anyio.to_thread.run_sync(self.server.runner.reset)
            if not delta:  # the served model is still the directory loaded last, patched by the delta
                self.server.model_path = model_path
            self._finish_update(body)
        log.info(
            "loaded %d tensors from %s (weight_version %s)", count, model_path, self.server.weight_version
        )
        return self._weights_result(True, f"Succeeded to update model weights ({count} tensors).")

    async def get_weights_by_name(self, request: Request) -> Response:
        """SGLang's `/get_weights_by_name`: `{"name", "truncate_size": 100}` → the parameter's values as nested
        lists, its first dimension truncated to `truncate_size` (float32 values survive JSON exactly)."""
        async def action(body: JsonObject) -> Response:
            name, size = body.get("name"), body.get("truncate_size", 100)
            if not isinstance(name, str) or not name:
                raise RequestError("'name' must be a parameter name")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise RequestError("'truncate_size' must be a positive integer")
            try:
                tensor = self.server.runner.weights_by_name(name)
            except WeightUpdateError as exc:
                raise RequestError(str(exc)) from None
            values = tensor.float().tolist()
            return JSONResponse(values[:size] if isinstance(values, list) else values)

        return await handle(request, self.server.args.max_request_bytes, action)

    def _model_device(self) -> torch.device:
        return next(self.server.runner.model.parameters()).device

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

    def _distributed_request(self, body: JsonObject) -> tuple[WeightUpdateGroup, list[torch.dtype]]:
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
            self.server.scheduler.abort(abort_all=True, message="Abort by update_weights_from_distributed")
        device = self._model_device() if group.backend == "nccl" else torch.device("cpu")
        receive_one = partial(
            receive, group, names, torch_dtypes, shapes, load_format=body.get("load_format"), device=device
        )
        async with self.server.scheduler.exclusive_update():
            try:
                # Receive every announced tensor even when the names turn out to be wrong: the trainer's
                # broadcasts must all be matched or rank 0 would block.
                tensors = await anyio.to_thread.run_sync(receive_one)
            except (RuntimeError, ValueError) as exc:
                return self._weights_result(False, f"Failed to receive weights: {exc}")
            try:
                count = await anyio.to_thread.run_sync(
                    partial(self.server.runner.load_tensors, dict(tensors), require_all=False)
                )
            except WeightUpdateError as exc:
                return self._weights_result(False, str(exc))
            if body.get("flush_cache", True) and not self.server.scheduler.running:
                await anyio.to_thread.run_sync(self.server.runner.reset)
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
