"""Dispatch of generate requests to rollout engines.

Owns the choice of engine for each prompt group (least requests in flight among the engines the fleet says are
alive; all samples of a group on one engine, for its prefix cache) and the retry of a request whose engine
died. With `--use-sglang-router` every request goes to the router instead, which balances and retries itself.

Invariant: `generate()` returns exactly one response per request or raises. A request is re-sent to another
engine only after the fleet confirmed its first engine is dead, so no response is counted twice; a request
whose engine is alive but answered 4xx raises at once (the request is wrong, retrying cannot help).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio

from coordinator.engines.client import EngineClient, EngineError, EngineHTTPError

log = logging.getLogger(__name__)


class EngineHandleLike(Protocol):
    name: str
    url: str


class EnginePool(Protocol):
    """What dispatch needs from the engine fleet (coordinator.engines.fleet.EngineFleet provides it)."""

    def alive(self) -> Sequence[Any]: ...

    async def check(self, handle: Any) -> bool: ...

    async def wait_any_alive(self, timeout: float) -> Any: ...

    def mark_dead(self, handle: Any, reason: str) -> None: ...


class NoEngineAvailable(RuntimeError):
    """Every rollout engine is dead and none came back within the wait."""


class Dispatcher:
    def __init__(
        self,
        *,
        client: EngineClient,
        pool: EnginePool | None,
        router_url: str | None = None,
        engine_wait: float = 120.0,
        max_attempts: int = 8,
    ) -> None:
        if pool is None and router_url is None:
            raise ValueError("Dispatcher needs an engine pool or a router URL")
        self.client = client
        self.pool = pool
        self.router_url = router_url
        self.engine_wait = engine_wait
        self.max_attempts = max_attempts
        self.in_flight: Counter[str] = Counter()
        # Groups assigned to an engine and not finished: picks happen before any request is in flight, so
        # least-loaded must count assignments too, or every group of a burst lands on the first engine.
        self.assigned: Counter[str] = Counter()
        self.retried = 0

    def _least_loaded(self, exclude: set[str]) -> Any | None:
        assert self.pool is not None
        candidates = [handle for handle in self.pool.alive() if handle.url not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda handle: (self.assigned[handle.url], self.in_flight[handle.url]))

    async def pick(self, exclude: set[str] | None = None) -> Any:
        """An alive engine with the fewest requests in flight; waits for one to come back if all are dead."""
        exclude = exclude or set()
        handle = self._least_loaded(exclude)
        if handle is None:
            handle = self._least_loaded(set())
        if handle is None:
            assert self.pool is not None
            try:
                await self.pool.wait_any_alive(self.engine_wait)
            except TimeoutError as error:
                raise NoEngineAvailable(
                    f"no rollout engine alive after waiting {self.engine_wait:.0f}s; see the engine logs in the "
                    "run directory"
                ) from error
            handle = self._least_loaded(set())
            if handle is None:
                raise NoEngineAvailable("no rollout engine alive")
        return handle

    @asynccontextmanager
    async def group_engine(self) -> AsyncIterator[Any]:
        """The engine one prompt group uses (None with a router): counted as assigned while the block runs."""
        if self.router_url is not None:
            yield None
            return
        handle = await self.pick()
        url = handle.url
        self.assigned[url] += 1
        try:
            yield handle
        finally:
            self.assigned[url] -= 1

    async def generate(
        self, payload: dict[str, Any], *, engine: Any | None = None
    ) -> tuple[dict[str, Any], str]:
        """Send one /generate request; return (response, url of the engine that answered)."""
        if self.router_url is not None:
            return await self._send(self.router_url, payload), self.router_url
        handle = engine if engine is not None else await self.pick()
        failed: set[str] = set()
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await self._send(handle.url, payload), handle.url
            except EngineHTTPError as error:
                if error.status < 500:
                    raise
                last_error: EngineError = error
            except EngineError as error:
                last_error = error
            assert self.pool is not None
            # The engine failed this request after the client's own retries: ask the fleet whether it is dead.
            if await self.pool.check(handle):
                raise last_error
            # A failed request and a failed probe: take it out of dispatch (the health monitor, when rollout
            # FT is on, relaunches it; otherwise the run goes on with the others).
            self.pool.mark_dead(handle, f"request failed ({last_error}) and the engine did not answer a probe")
            failed.add(handle.url)
            self.retried += 1
            log.warning(
                "engine %s died during a request (%s); retrying on another engine (attempt %d)",
                handle.url,
                last_error,
                attempt,
            )
            handle = await self.pick(exclude=failed)
        raise NoEngineAvailable(f"request failed on {self.max_attempts} engines in a row")

    async def _send(self, url: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.in_flight[url] += 1
        try:
            response = await self.client.engine(url).generate(payload)
        finally:
            self.in_flight[url] -= 1
        if isinstance(response, list):
            if len(response) != 1:
                raise EngineHTTPError(200, f"expected one generate result, got {len(response)}", url)
            response = response[0]
        return response

    async def abort_all(self) -> None:
        """Abort every request in flight on every alive engine (the rollout has what it needs)."""
        if self.router_url is not None and self.pool is None:
            return
        assert self.pool is not None
        urls = [handle.url for handle in self.pool.alive() if self.in_flight[handle.url] > 0]

        async def abort(url: str) -> None:
            try:
                with anyio.fail_after(10):
                    await self.client.engine(url).abort_request(abort_all=True)
            except (EngineError, TimeoutError) as error:
                log.warning("could not abort requests on %s: %s", url, error)

        async with anyio.create_task_group() as group:
            for url in urls:
                group.start_soon(abort, url)
