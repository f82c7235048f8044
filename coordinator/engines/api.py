"""Typed methods for one engine's endpoints (SGLang's HTTP API, as SGLANG_CONTRACT.md has it).

Owns: each endpoint's path, body and answer check (a 200 with `success: false` is a failure), which calls
fall back to an older path on 404, and which are collectives that are never retried. Invariant: an
`EngineAPI` holds no socket; every request goes through the client it is bound to (its pool, deadlines and
retries).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Protocol

import httpx

from coordinator.engines.bounded import generate_reply_limit, limits_for
from coordinator.engines.errors import EngineHTTPError
from coordinator.engines.policy import COLLECTIVE, RetryPolicy
from coordinator.engines.replies import GenerateAnswer
from coordinator.engines.reply_decode import read_generate_answer_async
from coordinator.engines.stream import stream_generate
from coordinator.engines.transport import EngineAnswer
from workers.boundary.json_input import JsonObject, JsonValue


class Requester(Protocol):
    """What an `EngineAPI` uses of the `EngineClient` it is bound to."""

    connect_timeout: float
    generate_timeout: float
    vocab_size: int | None

    @property
    def http(self) -> httpx.AsyncClient: ...

    async def request(self, base_url: str, method: str, path: str, **kw: object) -> EngineAnswer: ...

    async def request_json(self, base_url: str, method: str, path: str, **kw: object) -> JsonValue: ...


def _drop_none(d: JsonObject) -> JsonObject:
    return {k: v for k, v in d.items() if v is not None}


def _object(body: JsonValue, url: str) -> JsonObject:
    if not isinstance(body, dict):
        raise EngineHTTPError(200, f"expected a JSON object, got {body!r:.200}", url)
    return body


def _check_success(body: JsonValue, url: str) -> JsonObject:
    """SGLang control endpoints answer `{success, message}`; a 200 with success=false is still a failure."""
    body = _object(body, url)
    if body.get("success") is False:
        raise EngineHTTPError(200, str(body.get("message", "success=false")), url)
    return body


class EngineAPI:
    """Typed methods for one engine's endpoints; cheap to create, holds no socket."""

    __slots__ = ("client", "url")

    def __init__(self, client: Requester, url: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL must start with http:// or https://, got {url!r}")
        self.client = client
        self.url = url.rstrip("/")

    def __repr__(self) -> str:
        return f"EngineAPI({self.url!r})"

    async def _get(self, path: str, **kw: object) -> JsonValue:
        return await self.client.request_json(self.url, "GET", path, **kw)

    async def _post(self, path: str, body: JsonValue = None, **kw: object) -> JsonValue:
        return await self.client.request_json(
            self.url, "POST", path, json_body={} if body is None else body, **kw
        )

    # -- generation ----------------------------------------------------------------------------------

    async def generate(
        self, payload: Mapping[str, JsonValue], *, timeout: float | None = None, retry: RetryPolicy | None = None
    ) -> GenerateAnswer:
        """POST /generate; the answer's checked replies (one for one prompt with n=1, else prompts × n, prompt by
        prompt) and its bytes.

        The reply is read under the cap its request allows (`generate_reply_limit`), decoded once and every
        result checked (`reply_decode.read_generate_answer`): a reply out of SGLang's shape or the vocabulary
        raises `EngineReplyError`."""
        body = dict(payload)
        body.pop("stream", None)
        t = timeout if timeout is not None else self.client.generate_timeout
        cap = generate_reply_limit(body)
        resp = await self.client.request(self.url, "POST", "/generate", json_body=body, timeout=t, retry=retry,
                                         max_bytes=cap, answer_by=self.client.generation_bound(body))
        return await read_generate_answer_async(resp.content, self.url, body, self.client.vocab_size,
                                                limits_for(cap), source=str(resp.url))

    def generate_stream(
        self, payload: Mapping[str, JsonValue], *, timeout: float | None = None
    ) -> AsyncGenerator[JsonObject]:
        """POST /generate with stream=true; yields each SSE chunk (cumulative by default) until [DONE].

        Not retried once the status line arrived. Close it early with `contextlib.aclosing`.
        """
        body = dict(payload, stream=True)
        read = timeout if timeout is not None else self.client.generate_timeout
        return stream_generate(self.client, self.url, body, read=read)

    # -- health and info -----------------------------------------------------------------------------

    async def health(self, *, timeout: float | None = None, retry: RetryPolicy | None = None) -> None:
        """GET /health; returns when the engine answers 200."""
        await self.client.request(self.url, "GET", "/health", timeout=timeout, retry=retry)

    async def health_generate(
        self, *, timeout: float | None = 30.0, retry: RetryPolicy | None = None
    ) -> None:
        """GET /health_generate (a real 1-token generation); returns on 200."""
        await self.client.request(self.url, "GET", "/health_generate", timeout=timeout, retry=retry)

    async def _get_with_fallback(self, paths: Sequence[str], **kw: object) -> JsonValue:
        for path in paths[:-1]:
            try:
                return await self._get(path, **kw)
            except EngineHTTPError as exc:
                if exc.status != 404:
                    raise
        return await self._get(paths[-1], **kw)

    async def model_info(self, **kw: object) -> JsonObject:
        """GET /model_info (falls back to /get_model_info): model_path, tokenizer_path, weight_version..."""
        return _object(await self._get_with_fallback(["/model_info", "/get_model_info"], **kw), self.url)

    async def server_info(self, **kw: object) -> JsonObject:
        """GET /server_info (falls back to /get_server_info)."""
        return _object(await self._get_with_fallback(["/server_info", "/get_server_info"], **kw), self.url)

    async def get_weight_version(self, **kw: object) -> str:
        """The served weight version: /get_weight_version, or /model_info's field where that is gone (0.5.23)."""
        try:
            body = await self._get("/get_weight_version", **kw)
        except EngineHTTPError as exc:
            if exc.status != 404:
                raise
            body = await self.model_info(**kw)
        if not isinstance(body, dict) or "weight_version" not in body:
            raise EngineHTTPError(200, f"no weight_version in {body!r:.200}", self.url)
        return str(body["weight_version"])

    async def metrics(self, **kw: object) -> str:
        """GET /metrics: Prometheus text."""
        return (await self.client.request(self.url, "GET", "/metrics", **kw)).text

    # -- control -------------------------------------------------------------------------------------

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = True, **kw: object
    ) -> JsonObject:
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return _check_success(await self._post("/update_weight_version", body, **kw), self.url)

    async def flush_cache(self, **kw: object) -> str:
        """POST /flush_cache; raises EngineHTTPError(400) while requests are running."""
        return (await self.client.request(self.url, "POST", "/flush_cache", **kw)).text

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False, **kw: object) -> None:
        if rid is None and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        await self.client.request(
            self.url,
            "POST",
            "/abort_request",
            json_body=_drop_none({"rid": rid, "abort_all": abort_all}),
            **kw,
        )

    async def pause_generation(self, mode: str | None = "abort", **kw: object) -> None:
        """POST /pause_generation {mode}: "abort" | "retract" | "in_place" (None: no mode, pre-0.5.6)."""
        if mode not in (None, "abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        self.client.pausing(self.url)  # before it answers: a request may stand still from now on
        await self.client.request(
            self.url, "POST", "/pause_generation", json_body=_drop_none({"mode": mode}), **kw
        )

    async def continue_generation(self, **kw: object) -> None:
        try:
            await self.client.request(self.url, "POST", "/continue_generation", json_body={}, **kw)
        finally:
            self.client.continuing(self.url)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None, **kw: object) -> None:
        """Requires no in-flight request (the engine answers an error otherwise)."""
        body = {"tags": None if tags is None else list(tags)}
        await self.client.request(self.url, "POST", "/release_memory_occupation", json_body=body, **kw)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None, **kw: object) -> None:
        body = {"tags": None if tags is None else list(tags)}
        await self.client.request(self.url, "POST", "/resume_memory_occupation", json_body=body, **kw)

    # -- weight updates ------------------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        abort_all_requests: bool | None = None,
        weight_version: str | None = None,
        flush_cache: bool | None = None,
        timeout: float | None = 600.0,
        retry: RetryPolicy | None = None,
    ) -> JsonObject:
        body = _drop_none(
            {
                "model_path": str(model_path),
                "load_format": load_format,
                "abort_all_requests": abort_all_requests,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
            }
        )
        return _check_success(
            await self._post("/update_weights_from_disk", body, timeout=timeout, retry=retry), self.url
        )

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout: float | None = 600.0,
    ) -> JsonObject:
        """Blocks until the trainer's rank 0 joins the group; never retried (it is a collective)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        out = await self._post("/init_weights_update_group", body, timeout=timeout, retry=COLLECTIVE)
        return _check_success(out, self.url)

    async def update_weights_from_distributed(
        self,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        abort_all_requests: bool | None = None,
        weight_version: str | None = None,
        load_format: str | None = None,
        timeout: float | None = 600.0,
    ) -> JsonObject:
        """Receives the broadcasts of `names` in order from rank 0 (one flattened broadcast with
        `load_format="flattened_bucket"`); never retried (it is a collective). From SGLang 0.5.21 on it must
        run inside `begin_weight_update` / `end_weight_update`."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        body = _drop_none(
            {
                "names": list(names),
                "dtypes": list(dtypes),
                "shapes": [list(s) for s in shapes],
                "group_name": group_name,
                "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests,
                "weight_version": weight_version,
                "load_format": load_format,
            }
        )
        out = await self._post("/update_weights_from_distributed", body, timeout=timeout, retry=COLLECTIVE)
        return _check_success(out, self.url)

    async def begin_weight_update(self, selector: str = "all", **kw: object) -> bool:
        """Open a weight-update session (SGLang 0.5.21+). False when the server has no such endpoint (404:
        older servers need no session); EngineHTTPError when it refuses (e.g. a session is already open)."""
        try:
            kw.setdefault("retry", COLLECTIVE)  # a repeated begin would find its own session open
            _check_success(await self._post("/begin_weight_update", {"selector": selector}, **kw), self.url)
        except EngineHTTPError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def end_weight_update(self, **kw: object) -> JsonObject:
        """Close the session `begin_weight_update` opened."""
        kw.setdefault("retry", COLLECTIVE)
        return _check_success(await self._post("/end_weight_update", {}, **kw), self.url)

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", **kw: object
    ) -> JsonObject:
        return _check_success(
            await self._post("/destroy_weights_update_group", {"group_name": group_name}, **kw), self.url
        )
