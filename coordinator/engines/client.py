"""The engine client: one HTTP connection pool for every engine the coordinator talks to.

Owns: the `httpx.AsyncClient` (over `httpx_aiohttp.AiohttpTransport`) through which every request to an
SGLang-compatible engine goes, the retry policy, and the mapping of transport failures to typed errors.

Invariants:
  * One pool per `EngineClient`, sized to the configured concurrency, shared by all engines: the rollout
    path with 512 requests in flight over N engines holds at most `max_connections` sockets.
  * Every call has a deadline (connect timeout + per-request read timeout).
  * Only transport errors and 5xx are retried, with exponential backoff inside a total budget; a 4xx raises
    `EngineHTTPError` at once with the server's own message.
  * Callers see only `EngineError` subclasses, never an httpx/aiohttp exception.

Transport choice (bench/client_transport.py, 4000 POSTs to a trivial local uvicorn server, 2 cores):
httpx default transport ~280 req/s at concurrency 64 and ~160 at 512; httpx over AiohttpTransport ~2,050-2,700
and ~2,260 (x7-x14); bare aiohttp ~6,900 and ~5,300. We keep the httpx API over the aiohttp transport: an
order of magnitude above the default and far above what engines serve (generate calls take seconds).

Usage::

    async with EngineClient(max_connections=512, api_key=key) as client:
        engine = client.engine("http://127.0.0.1:30000")
        out = await engine.generate({"text": "hi", "sampling_params": {"max_new_tokens": 8}})
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import httpx
from httpx_aiohttp import AiohttpTransport

from workers.errors import RaylessError

JSON = Any  # parsed JSON value: dict, list, str, number, bool or None


# --------------------------------------------------------------------------------------------- errors


class EngineError(RaylessError):
    """Base of every error the engine client raises."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.message = message
        self.url = url


class EngineHTTPError(EngineError):
    """The engine answered with an error status (4xx at once, 5xx after the retries ran out).

    `error_type`: the `type` of the server's `{"error": {...}}` body when it names one — our engine says
    "MemoryReleased" while its memory is released (`released`), so a caller can tell that from a failure."""

    def __init__(self, status: int, message: str, url: str, error_type: str | None = None) -> None:
        super().__init__(f"{url} answered HTTP {status}: {message}", url)
        self.status = status
        self.server_message = message
        self.error_type = error_type

    @property
    def released(self) -> bool:
        """The engine refused because its memory is released (`/release_memory_occupation`): alive, not dead."""
        return self.error_type == MEMORY_RELEASED


class EngineStreamError(EngineHTTPError):
    """A streamed generate reported `data: {"error": ...}` in the middle of an HTTP 200 stream."""


class EngineUnreachable(EngineError):
    """No answer: connection refused or reset, or the engine closed the connection (it died)."""

    def __init__(self, url: str, cause: BaseException | str) -> None:
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"engine {url} unreachable ({text})", url)
        self.cause = cause


class EngineTimeout(EngineError):
    """The engine did not answer (connect or read) within the deadline."""

    def __init__(self, url: str, timeout: float | None, cause: BaseException | str) -> None:
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"engine {url} did not answer within {timeout}s ({text})", url)
        self.timeout = timeout
        self.cause = cause


# --------------------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries on transport errors and 5xx: exponential backoff with jitter and a total budget.

    `attempts` counts the first try (1 = no retry). No new attempt starts when its backoff would end past
    `budget` seconds after the first try began.
    """

    attempts: int = 3
    backoff: float = 0.2
    backoff_max: float = 3.0
    budget: float = 30.0

    def delay(self, attempt: int) -> float:
        base = min(self.backoff * (2 ** (attempt - 1)), self.backoff_max)
        return base * (0.5 + random.random() / 2)  # jitter so N callers don't retry in lockstep


NO_RETRY = RetryPolicy(attempts=1)

# Calls that must not be repeated: the server joins a collective / consumes broadcasts in order.
_COLLECTIVE = NO_RETRY


#: the error type our engine answers with while its memory is released (503)
MEMORY_RELEASED = "MemoryReleased"


def _server_error_type(resp: httpx.Response) -> str | None:
    """`error.type` of a `{"error": {"type": ...}}` body, else None."""
    try:
        body = json.loads(resp.text)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else None


def _server_message(resp: httpx.Response) -> str:
    """The server's error text: SGLang's `{"error": {"message"}}`, `{"error": str}`, FastAPI `detail`, text."""
    text = resp.text
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip() or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return json.dumps(body["detail"]) if not isinstance(body["detail"], str) else body["detail"]
    return text.strip()


def _map_transport_error(exc: BaseException, url: str, timeout: float | None) -> EngineError:
    """Classify a transport failure. AiohttpTransport maps aiohttp errors loosely (a server disconnect
    becomes httpx.ConnectTimeout), so the original aiohttp exception in `__cause__` decides when present."""
    cause = exc.__cause__ if isinstance(exc, httpx.HTTPError) and exc.__cause__ is not None else exc
    if isinstance(cause, aiohttp.ClientError | TimeoutError):
        if isinstance(cause, aiohttp.ServerTimeoutError | TimeoutError):
            return EngineTimeout(url, timeout, cause)
        return EngineUnreachable(url, cause)
    if isinstance(exc, httpx.TimeoutException):
        return EngineTimeout(url, timeout, exc)
    return EngineUnreachable(url, exc)


_TRANSPORT_ERRORS = (httpx.TransportError, aiohttp.ClientError, TimeoutError, ConnectionError)


# --------------------------------------------------------------------------------------------- client


class EngineClient(anyio.AsyncContextManagerMixin):
    """Shared HTTP pool to any number of engines; open with `async with`.

    Args:
        max_connections: pool size; set it to the concurrency you will drive (e.g. the generate
            concurrency over all rollout engines) so requests never queue for a socket.
        api_key: sent as `Authorization: Bearer <key>` on every request when set.
        connect_timeout: seconds to open a TCP connection.
        read_timeout: default seconds to wait for a response (each call may override).
        generate_timeout: default read timeout for `/generate` (long generations).
        retry: default retry policy.
        transport: "aiohttp" (default, measured fastest with the httpx API) or "httpx" (httpcore).
    """

    def __init__(
        self,
        *,
        max_connections: int = 256,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        generate_timeout: float = 3600.0,
        retry: RetryPolicy = RetryPolicy(),
        transport: str = "aiohttp",
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if transport not in ("aiohttp", "httpx"):
            raise ValueError(f"transport must be 'aiohttp' or 'httpx', got {transport!r}")
        self.max_connections = max_connections
        self.api_key = api_key
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.generate_timeout = generate_timeout
        self.retry = retry
        self.transport = transport
        self._http: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[EngineClient]:
        limits = httpx.Limits(
            max_connections=self.max_connections, max_keepalive_connections=self.max_connections
        )
        # pool=None: waiting for a free socket is bounded by the caller's concurrency, not by a timeout.
        timeout = httpx.Timeout(connect=self.connect_timeout, read=self.read_timeout, write=30.0, pool=None)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        transport: httpx.AsyncBaseTransport | None = None
        if self.transport == "aiohttp":
            transport = AiohttpTransport(limits=limits, trust_env=False)
        async with httpx.AsyncClient(
            transport=transport, limits=limits, timeout=timeout, headers=headers, trust_env=False
        ) as http:
            self._http = http
            try:
                yield self
            finally:
                self._http = None

    def engine(self, url: str) -> EngineAPI:
        """A light handle bound to one engine's base URL (shares this client's pool)."""
        return EngineAPI(self, url)

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("EngineClient is not open: use `async with EngineClient(...) as client`")
        return self._http

    async def request(
        self,
        base_url: str,
        method: str,
        path: str,
        *,
        json_body: JSON = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """Send one request with retries; return the 2xx response or raise an `EngineError`. `headers` are
        added to this request only (the client's own, e.g. the API key, are sent as well)."""
        url = base_url.rstrip("/") + path
        policy = retry or self.retry
        read = timeout if timeout is not None else self.read_timeout
        req_timeout = httpx.Timeout(connect=self.connect_timeout, read=read, write=30.0, pool=None)
        content = None if json_body is None else json.dumps(json_body).encode()
        headers = {**({"Content-Type": "application/json"} if content is not None else {}), **(headers or {})}
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            error: EngineError
            try:
                resp = await self.http.request(
                    method, url, content=content, params=params, headers=headers, timeout=req_timeout
                )
            except _TRANSPORT_ERRORS as exc:
                error = _map_transport_error(exc, url, read)
            else:
                if resp.status_code < 400:
                    return resp
                error = EngineHTTPError(resp.status_code, _server_message(resp), url, _server_error_type(resp))
                if resp.status_code < 500 or error.released:
                    raise error  # 4xx: the request is wrong; released: repeating it cannot help either
            wait = policy.delay(attempt)
            if attempt >= policy.attempts or time.monotonic() - start + wait > policy.budget:
                raise error
            await anyio.sleep(wait)

    async def request_json(self, base_url: str, method: str, path: str, **kw: Any) -> JSON:
        resp = await self.request(base_url, method, path, **kw)
        try:
            return resp.json()
        except ValueError as exc:
            raise EngineHTTPError(
                resp.status_code, f"response is not JSON: {resp.text[:200]!r}", str(resp.url)
            ) from exc


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _check_success(body: JSON, url: str) -> dict[str, Any]:
    """SGLang control endpoints answer `{success, message}`; a 200 with success=false is still a failure."""
    if not isinstance(body, dict):
        raise EngineHTTPError(200, f"expected a JSON object, got {body!r:.200}", url)
    if body.get("success") is False:
        raise EngineHTTPError(200, str(body.get("message", "success=false")), url)
    return body


class EngineAPI:
    """Typed methods for one engine's endpoints (SGLANG_CONTRACT.md); cheap to create, holds no socket."""

    __slots__ = ("client", "url")

    def __init__(self, client: EngineClient, url: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL must start with http:// or https://, got {url!r}")
        self.client = client
        self.url = url.rstrip("/")

    def __repr__(self) -> str:
        return f"EngineAPI({self.url!r})"

    async def _get(self, path: str, **kw: Any) -> JSON:
        return await self.client.request_json(self.url, "GET", path, **kw)

    async def _post(self, path: str, body: JSON = None, **kw: Any) -> JSON:
        return await self.client.request_json(
            self.url, "POST", path, json_body={} if body is None else body, **kw
        )

    # -- generation ----------------------------------------------------------------------------------

    async def generate(
        self, payload: Mapping[str, Any], *, timeout: float | None = None, retry: RetryPolicy | None = None
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """POST /generate; a dict for one prompt with n=1, else a list (prompts × n, prompt by prompt)."""
        body = dict(payload)
        body.pop("stream", None)
        t = timeout if timeout is not None else self.client.generate_timeout
        return await self._post("/generate", body, timeout=t, retry=retry)

    async def generate_stream(
        self, payload: Mapping[str, Any], *, timeout: float | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """POST /generate with stream=true; yields each SSE chunk (cumulative by default) until [DONE].

        Not retried once the status line arrived. Close it early with `contextlib.aclosing`.
        """
        body = dict(payload, stream=True)
        read = timeout if timeout is not None else self.client.generate_timeout
        url = self.url + "/generate"
        req_timeout = httpx.Timeout(connect=self.client.connect_timeout, read=read, write=30.0, pool=None)
        try:
            async with self.client.http.stream("POST", url, json=body, timeout=req_timeout) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise EngineHTTPError(resp.status_code, _server_message(resp), url, _server_error_type(resp))
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if isinstance(chunk, dict) and "error" in chunk:
                        err = chunk["error"]
                        msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                        status = err.get("code", 200) if isinstance(err, dict) else 200
                        raise EngineStreamError(int(status) if isinstance(status, int) else 200, msg, url)
                    yield chunk
        except _TRANSPORT_ERRORS as exc:
            raise _map_transport_error(exc, url, read) from exc

    # -- health and info -----------------------------------------------------------------------------

    async def health(self, *, timeout: float | None = None, retry: RetryPolicy | None = None) -> None:
        """GET /health; returns when the engine answers 200."""
        await self.client.request(self.url, "GET", "/health", timeout=timeout, retry=retry)

    async def health_generate(
        self, *, timeout: float | None = 30.0, retry: RetryPolicy | None = None
    ) -> None:
        """GET /health_generate (a real 1-token generation); returns on 200."""
        await self.client.request(self.url, "GET", "/health_generate", timeout=timeout, retry=retry)

    async def _get_with_fallback(self, paths: Sequence[str], **kw: Any) -> JSON:
        for path in paths[:-1]:
            try:
                return await self._get(path, **kw)
            except EngineHTTPError as exc:
                if exc.status != 404:
                    raise
        return await self._get(paths[-1], **kw)

    async def model_info(self, **kw: Any) -> dict[str, Any]:
        """GET /model_info (falls back to /get_model_info): model_path, tokenizer_path, weight_version..."""
        return await self._get_with_fallback(["/model_info", "/get_model_info"], **kw)

    async def server_info(self, **kw: Any) -> dict[str, Any]:
        """GET /server_info (falls back to /get_server_info)."""
        return await self._get_with_fallback(["/server_info", "/get_server_info"], **kw)

    async def get_weight_version(self, **kw: Any) -> str:
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

    async def metrics(self, **kw: Any) -> str:
        """GET /metrics: Prometheus text."""
        return (await self.client.request(self.url, "GET", "/metrics", **kw)).text

    # -- control -------------------------------------------------------------------------------------

    async def update_weight_version(
        self, new_version: str, *, abort_all_requests: bool = True, **kw: Any
    ) -> dict[str, Any]:
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return _check_success(await self._post("/update_weight_version", body, **kw), self.url)

    async def flush_cache(self, **kw: Any) -> str:
        """POST /flush_cache; raises EngineHTTPError(400) while requests are running."""
        return (await self.client.request(self.url, "POST", "/flush_cache", **kw)).text

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False, **kw: Any) -> None:
        if rid is None and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        await self.client.request(
            self.url,
            "POST",
            "/abort_request",
            json_body=_drop_none({"rid": rid, "abort_all": abort_all}),
            **kw,
        )

    async def pause_generation(self, mode: str | None = "abort", **kw: Any) -> None:
        """POST /pause_generation {mode}: "abort" | "retract" | "in_place" (None: no mode, pre-0.5.6)."""
        if mode not in (None, "abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        await self.client.request(
            self.url, "POST", "/pause_generation", json_body=_drop_none({"mode": mode}), **kw
        )

    async def continue_generation(self, **kw: Any) -> None:
        await self.client.request(self.url, "POST", "/continue_generation", json_body={}, **kw)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None, **kw: Any) -> None:
        """Requires no in-flight request (the engine answers an error otherwise)."""
        body = {"tags": None if tags is None else list(tags)}
        await self.client.request(self.url, "POST", "/release_memory_occupation", json_body=body, **kw)

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None, **kw: Any) -> None:
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
    ) -> dict[str, Any]:
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
    ) -> dict[str, Any]:
        """Blocks until the trainer's rank 0 joins the group; never retried (it is a collective)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        out = await self._post("/init_weights_update_group", body, timeout=timeout, retry=_COLLECTIVE)
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
    ) -> dict[str, Any]:
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
        out = await self._post("/update_weights_from_distributed", body, timeout=timeout, retry=_COLLECTIVE)
        return _check_success(out, self.url)

    async def begin_weight_update(self, selector: str = "all", **kw: Any) -> bool:
        """Open a weight-update session (SGLang 0.5.21+). False when the server has no such endpoint (404:
        older servers need no session); EngineHTTPError when it refuses (e.g. a session is already open)."""
        try:
            kw.setdefault("retry", _COLLECTIVE)  # a repeated begin would find its own session open
            _check_success(await self._post("/begin_weight_update", {"selector": selector}, **kw), self.url)
        except EngineHTTPError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def end_weight_update(self, **kw: Any) -> dict[str, Any]:
        """Close the session `begin_weight_update` opened."""
        kw.setdefault("retry", _COLLECTIVE)
        return _check_success(await self._post("/end_weight_update", {}, **kw), self.url)

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", **kw: Any
    ) -> dict[str, Any]:
        return _check_success(
            await self._post("/destroy_weights_update_group", {"group_name": group_name}, **kw), self.url
        )
