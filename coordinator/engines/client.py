"""The engine client: one HTTP connection pool for every engine the coordinator talks to.

Owns: the `aiohttp.ClientSession` (and its pool) through which every request to an SGLang-compatible engine
goes — a whole-answer request (`request`: `/generate`, control, info) on the session itself, a streamed
`/generate` and the stall watch's `/health` probe through an `httpx.AsyncClient` over
`httpx_aiohttp.AiohttpTransport` on the same session — and the request loop that applies the retry policy
(`policy`) and maps failures to typed errors (`errors`). One engine's endpoints are methods of `EngineAPI`
(`api`).

Invariants:
  * One pool per `EngineClient`, sized to the configured concurrency, shared by all engines and both APIs:
    the rollout path with 512 requests in flight over N engines holds at most `max_connections` sockets.
  * Every call has a deadline (connect timeout + per-request read timeout), and no reply may stop moving for
    longer than `stall_timeout` (`stall`: a body that drips, an engine that accepts and answers nothing) —
    that ends as `EngineStalled`, not retried on the same engine.
  * Only transport errors and 5xx are retried, with exponential backoff inside a total budget; a 4xx raises
    `EngineHTTPError` at once with the server's own message.
  * Callers see only `EngineError` subclasses, never an httpx/aiohttp exception.
  * Every body is read under a byte cap as it streams (`bounded`) and decoded through the boundary layer;
    every `/generate` reply is checked against SGLang's shape and the vocabulary (`replies`) before a
    caller sees it, so a hostile or broken peer's reply is one `EngineReplyError`.

Transport choice (bench/client_transport.py, 4000 POSTs to a trivial local uvicorn server, 2 cores):
httpx default transport ~280 req/s at concurrency 64 and ~160 at 512; httpx over AiohttpTransport ~2,050-2,700
and ~2,260 (x7-x14); bare aiohttp ~6,900 and ~5,300. httpx's own layers (request and URL models, cookies,
auth and redirect wrappers, the response model) cost more than the socket work on the rollout path
(bench/rollout_overhead.py, issue 38), so whole-answer requests go on the aiohttp session directly and
return an `EngineAnswer`; httpx stays where a stream is read line by line (its share there is small).

Usage::

    async with EngineClient(max_connections=512, api_key=key) as client:
        engine = client.engine("http://127.0.0.1:30000")
        out = await engine.generate({"text": "hi", "sampling_params": {"max_new_tokens": 8}})
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager

import aiohttp
import anyio
import anyio.abc
import httpx
import msgspec
from httpx_aiohttp import AiohttpTransport

from coordinator.engines.api import EngineAPI
from coordinator.engines.bounded import DEFAULT_REPLY_BYTES, decode_reply, read_capped, read_prefix
from coordinator.engines.errors import EngineError
from coordinator.engines.policy import RetryPolicy
from coordinator.engines.stall import PROBE_S, HeadWatch, Liveness, ReplyClock, progressing
from coordinator.engines.transport import (
    TRANSPORT_ERRORS,
    EngineAnswer,
    aiohttp_timeout,
    error_from_response,
    map_transport_error,
    request_timeout,
)
from workers.boundary.engine_routes import is_admin
from workers.boundary.json_input import JsonValue


class EngineClient(anyio.AsyncContextManagerMixin):
    """Shared HTTP pool to any number of engines; open with `async with`.

    Args:
        max_connections: pool size; set it to the concurrency you will drive (e.g. the generate
            concurrency over all rollout engines) so requests never queue for a socket.
        api_key: sent as `Authorization: Bearer <key>` on every request when set.
        admin_api_key: the engines' `--admin-api-key`: sent instead on their control routes
            (`workers.boundary.engine_routes.is_admin`), which the API key does not open then.
        connect_timeout: seconds to open a TCP connection.
        read_timeout: default seconds to wait for a response (each call may override).
        generate_timeout: default read timeout for `/generate` (long generations).
        stall_timeout: seconds a reply may go without progress (`stall`; `--engine-stall-timeout-s`); also a
            non-streamed generate's head allowance in its generation bound.
        token_timeout: seconds per requested new token in a non-streamed generate's bound
            (`--engine-token-timeout-s`; `stall.HeadWatch`).
        probe_timeout: seconds the `/health` probe of an engine whose answer is late may take (`stall.PROBE_S`).
        retry: default retry policy.
        transport: what the httpx client (streamed generates, the stall probe) runs on: "aiohttp" (default,
            the session's pool) or "httpx" (httpcore, a pool of its own). Whole answers always go on the session.
        trace_configs: aiohttp's request hooks (`aiohttp.TraceConfig`), told of every request sent on the
            session (a test counts attempts with them).
    """

    def __init__(
        self,
        *,
        max_connections: int = 256,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        generate_timeout: float = 3600.0,
        stall_timeout: float = 120.0,
        token_timeout: float = 1.0,
        probe_timeout: float = PROBE_S,
        retry: RetryPolicy = RetryPolicy(),
        transport: str = "aiohttp",
        trace_configs: Sequence[aiohttp.TraceConfig] = (),
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if transport not in ("aiohttp", "httpx"):
            raise ValueError(f"transport must be 'aiohttp' or 'httpx', got {transport!r}")
        self.max_connections = max_connections
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.generate_timeout = generate_timeout
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0, got {stall_timeout}")
        self.stall_timeout = stall_timeout
        if not token_timeout > 0:
            raise ValueError(f"token_timeout must be > 0, got {token_timeout}")
        self.token_timeout = token_timeout
        #: per engine base URL: [paused since (monotonic) or None, seconds paused before that] — the time its
        #: generation stood still for a weight update, which no generation bound counts
        self._paused: dict[str, list[float | None]] = {}
        #: the head-liveness rule and the generation bound; `watch_stalls` runs it
        self.head_watch = HeadWatch(Liveness(lambda: self.http, fresh=stall_timeout / 2, probe_s=probe_timeout),
                                    stall_timeout, self.paused_for)
        self.retry = retry
        self.transport = transport
        #: the model's vocabulary (`set_vocab_size`, once the tokenizer is loaded): ids a reply may hold
        self.vocab_size: int | None = None
        self.trace_configs = list(trace_configs)
        self._http: httpx.AsyncClient | None = None
        self._session: aiohttp.ClientSession | None = None

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[EngineClient]:
        limits = httpx.Limits(
            max_connections=self.max_connections, max_keepalive_connections=self.max_connections
        )
        timeout = request_timeout(self.connect_timeout, self.read_timeout)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # keepalive: httpx's default expiry (5 s), as the transport had it before the session was shared
        connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=5.0)
        session = aiohttp.ClientSession(connector=connector, headers=headers, trust_env=False,
                                        trace_configs=self.trace_configs or None)
        transport: httpx.AsyncBaseTransport | None = None
        if self.transport == "aiohttp":
            transport = AiohttpTransport(limits=limits, trust_env=False, client=session)
        try:
            async with httpx.AsyncClient(
                transport=transport, limits=limits, timeout=timeout, headers=headers, trust_env=False
            ) as http:
                self._http, self._session = http, session
                try:
                    yield self
                finally:
                    self._http = self._session = None
        finally:
            await session.close()  # idempotent: the transport closes it too when it is the httpx one's

    def set_vocab_size(self, size: int | None) -> None:
        """Bound the token ids every `/generate` reply may hold to `[0, size)` from now on."""
        if size is not None and size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {size}")
        self.vocab_size = size

    def engine(self, url: str) -> EngineAPI:
        """A light handle bound to one engine's base URL (shares this client's pool)."""
        return EngineAPI(self, url)

    def generation_bound(self, body: Mapping[str, JsonValue]) -> tuple[float, str]:
        """Seconds a non-streamed generate of `body` may take (the engine's unpaused time) and how they were
        derived: the head allowance (`stall_timeout`) + its largest max_new_tokens × `token_timeout` (SGLang's
        default of 128 when it names none)."""
        params = body.get("sampling_params")
        each = params if isinstance(params, list) else [params]
        asked = [p.get("max_new_tokens") if isinstance(p, dict) else None for p in each or [None]]
        tokens = max(DEFAULT_MAX_NEW_TOKENS if n is None or isinstance(n, bool) or not isinstance(n, int) else n
                     for n in asked)
        return (self.stall_timeout + tokens * self.token_timeout,
                f"{self.stall_timeout:g} s + {tokens} new tokens × {self.token_timeout:g} s "
                "(--engine-stall-timeout-s, --engine-token-timeout-s)")

    def pausing(self, base_url: str) -> None:
        """The engine at `base_url` is being paused (`/pause_generation`): its clock stops for the bounds."""
        ledger = self._paused.setdefault(base_url.rstrip("/"), [None, 0.0])
        if ledger[0] is None:
            ledger[0] = time.monotonic()

    def continuing(self, base_url: str) -> None:
        """The engine at `base_url` generates again (`/continue_generation`, answered or not)."""
        ledger = self._paused.get(base_url.rstrip("/"))
        if ledger is not None and ledger[0] is not None:
            ledger[1] = (ledger[1] or 0.0) + time.monotonic() - ledger[0]
            ledger[0] = None

    def paused_for(self, base_url: str) -> float:
        """Seconds the engine at `base_url` has been paused for weight updates, the current pause included."""
        since, before = self._paused.get(base_url, (None, 0.0))
        return (before or 0.0) + (time.monotonic() - since if since is not None else 0.0)

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("EngineClient is not open: use `async with EngineClient(...) as client`")
        return self._http

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EngineClient is not open: use `async with EngineClient(...) as client`")
        return self._session

    async def request(
        self,
        base_url: str,
        method: str,
        path: str,
        *,
        json_body: JsonValue = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        headers: Mapping[str, str] | None = None,
        max_bytes: int = DEFAULT_REPLY_BYTES,
        answer_by: tuple[float, str] | None = None,
    ) -> EngineAnswer:
        """Send one request with retries; return the 2xx response or raise an `EngineError`. `headers` are
        added to this request only (the client's own, e.g. the API key, are sent as well). The body is read
        as it streams in and refused (`EngineReplyError`, not retried) past `max_bytes`. `answer_by`: the generation bound
        (`generation_bound`) each attempt's answer must come within, ended by the head watch."""
        url = base_url.rstrip("/") + path
        policy = retry or self.retry
        read = timeout if timeout is not None else self.read_timeout
        req_timeout = aiohttp_timeout(self.connect_timeout, read)
        content = None if json_body is None else msgspec.json.encode(json_body)  # ~3x json.dumps, same JSON
        headers = {**({"Content-Type": "application/json"} if content is not None else {}), **(headers or {})}
        if self.admin_api_key and is_admin(path):  # a control route: the admin key, never the agents' one
            headers["Authorization"] = f"Bearer {self.admin_api_key}"
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            error: EngineError
            try:
                resp = await self._send_capped(base_url, f"{method} {path}", url, content, params, headers,
                                               req_timeout, max_bytes, read, answer_by)
            except TRANSPORT_ERRORS as exc:
                error = map_transport_error(exc, url, read)
            else:
                if resp.status_code < 400:
                    return resp
                error = error_from_response(resp, url)
                if resp.status_code < 500 or error.released:
                    raise error  # 4xx: the request is wrong; released: repeating it cannot help either
            wait = policy.delay(attempt)
            if attempt >= policy.attempts or time.monotonic() - start + wait > policy.budget:
                raise error
            await anyio.sleep(wait)

    async def _send_capped(self, base_url: str, what: str, url: str, content: bytes | None,
                           params: Mapping[str, str] | None, headers: Mapping[str, str],
                           timeout: aiohttp.ClientTimeout, max_bytes: int, read: float | None,
                           answer_by: tuple[float, str] | None = None) -> EngineAnswer:
        """One exchange on the session, its body read under the cap and the stall rules."""
        started = time.monotonic()
        with ReplyClock(stall=self.stall_timeout, url=url, base_url=base_url.rstrip("/"), what=what, started=started,
                        watch=self.head_watch, limit=read, answer_by=answer_by) as clock:
            async with self.session.request(what.split(" ", 1)[0], url, data=content, params=params, headers=headers,
                                            timeout=timeout, allow_redirects=False) as resp:
                clock.headed()
                stream = _AiohttpBody(resp)
                body = await (read_capped(stream, max_bytes, url, clock.advance) if resp.status < 400
                              else read_prefix(stream, on_chunk=clock.advance))
        return EngineAnswer(resp.status, resp.headers, body, str(resp.url))

    async def watch_stalls(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The head-liveness rule for this client's requests (`stall.HeadWatch`), until cancelled; the run
        starts it in its task group (without it the body rule and the read timeouts still hold)."""
        await self.head_watch.run(task_status=task_status)

    def stall_watch(self, url: str, what: str,
                    started: float) -> Callable[[AsyncIterator[bytes], Callable[[], bool]], AsyncIterator[bytes]]:
        """The body-progress rule for a streamed reply read line by line (`stall.progressing`)."""
        return lambda chunks, between: progressing(chunks, stall=self.stall_timeout, url=url, what=what,
                                                   started=started, between=between)

    async def request_json(self, base_url: str, method: str, path: str, **kw: object) -> JsonValue:
        """`request`, its body decoded through the boundary layer (bounded in size, depth and element count)."""
        resp = await self.request(base_url, method, path, **kw)
        return await decode_reply(resp.content, str(resp.url), kw.get("max_bytes", DEFAULT_REPLY_BYTES))


#: SGLang's max_new_tokens when a request names none (sampling_params.py)
DEFAULT_MAX_NEW_TOKENS = 128



class _AiohttpBody:
    """An aiohttp response as the capped readers take it (`bounded.BodyStream`): its headers and its (decoded)
    body's chunks as they arrive."""

    __slots__ = ("_resp", "headers")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.headers = resp.headers

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return self._resp.content.iter_any()
