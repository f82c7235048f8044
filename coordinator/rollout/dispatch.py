"""Dispatch of generate requests to rollout engines.

Owns the choice of engine for each prompt group (least requests in flight among the engines the fleet says are
alive; all samples of a group on one engine, for its prefix cache) and the retry of a request whose engine
died. With `--use-sglang-router` every request goes to the router instead, which balances and retries itself.

Invariant: `generate()` returns exactly one answer per request, its checked replies as many as the request has
prompts (`GenerateAnswer`, decoded once by the engine client), or raises. A request is re-sent to another
engine only after the fleet confirmed its first engine is dead (a request still waiting on an engine the fleet
marks dead is abandoned then, not at its timeout), so no response is counted twice; a request
whose engine is alive but answered 4xx raises at once (the request is wrong, retrying cannot help). A reply
the engine client refused (`EngineReplyError`: too large, not bounded JSON, out of SGLang's shape or the
vocabulary), and a request an engine that still answers its probe failed (a 5xx, a dropped connection), are
counted per peer (`refused`), the engine kept out of picks for `quarantine_s`, and the request re-sent to
another engine, as a dead engine's would be: a hostile peer costs retries, never the run. A request that fails
on `max_attempts` engines in a row raises NoEngineAvailable with the counts.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol

import anyio

from coordinator.engines.errors import EngineError, EngineHTTPError, EngineReplyError, EngineUnreachable
from coordinator.engines.replies import GenerateAnswer
from workers.boundary.json_input import JsonValue
from workers.errors import RaylessError

if TYPE_CHECKING:
    from coordinator.engines.client import EngineClient

log = logging.getLogger(__name__)


class EngineHandleLike(Protocol):
    name: str
    url: str


class EnginePool(Protocol):
    """What dispatch needs from the engine fleet (coordinator.engines.fleet.EngineFleet provides it)."""

    def alive(self) -> Sequence[EngineHandleLike]: ...

    async def check(self, handle: EngineHandleLike) -> bool: ...

    async def wait_any_alive(self, timeout: float) -> EngineHandleLike: ...

    def mark_dead(self, handle: EngineHandleLike, reason: str) -> None: ...


def _still_alive(handle: EngineHandleLike) -> bool:
    return bool(getattr(handle, "alive", True))


class NoEngineAvailable(RaylessError, RuntimeError):
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
        watch_engine_state: bool = True,
        quarantine_s: float = 30.0,
    ) -> None:
        """`watch_engine_state`: abandon a request as soon as the fleet marks its engine dead. Only a health
        monitor marks a live-but-hung engine dead, so runs without one skip the per-request watcher task."""
        if pool is None and router_url is None:
            raise ValueError("Dispatcher needs an engine pool or a router URL")
        self.client = client
        self.pool = pool
        self.router_url = router_url
        self.engine_wait = engine_wait
        self.max_attempts = max_attempts
        self.watch_engine_state = watch_engine_state
        self.in_flight: Counter[str] = Counter()
        # Groups assigned to an engine and not finished: picks happen before any request is in flight, so
        # least-loaded must count assignments too, or every group of a burst lands on the first engine.
        self.assigned: Counter[str] = Counter()
        self.retried = 0
        #: replies refused per peer (`EngineReplyError`), and until when (monotonic) a peer is kept out of picks
        self.refused: Counter[str] = Counter()
        self.quarantine_s = quarantine_s
        self._quarantined: dict[str, float] = {}

    @property
    def refused_total(self) -> int:
        return sum(self.refused.values())

    def _refused(self, url: str, error: EngineReplyError, attempt: int) -> None:
        self.refused[url] += 1
        self._quarantined[url] = time.monotonic() + self.quarantine_s
        log.warning("refused a reply from %s (%s); %d refused from it so far; re-sending the request "
                    "(attempt %d)", url, error.reason, self.refused[url], attempt)

    def _failed_alive(self, url: str, error: EngineError, attempt: int) -> None:
        self.refused[url] += 1
        self._quarantined[url] = time.monotonic() + self.quarantine_s
        log.warning("engine %s failed a request but answers its probe (%s); %d refused from it so far; "
                    "re-sending the request (attempt %d)", url, error, self.refused[url], attempt)

    def _in_quarantine(self, url: str) -> bool:
        until = self._quarantined.get(url)
        return until is not None and time.monotonic() < until

    def _least_loaded(self, exclude: set[str]) -> EngineHandleLike | None:
        assert self.pool is not None
        candidates = [handle for handle in self.pool.alive() if handle.url not in exclude]
        # A peer whose reply was just refused gets requests only when no other engine is left.
        candidates = [handle for handle in candidates if not self._in_quarantine(handle.url)] or candidates
        if not candidates:
            return None
        return min(candidates, key=lambda handle: (self.assigned[handle.url], self.in_flight[handle.url]))

    async def pick(self, exclude: set[str] | None = None) -> EngineHandleLike:
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
    async def group_engine(self) -> AsyncIterator[EngineHandleLike | None]:
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
        self, payload: dict[str, JsonValue], *, engine: EngineHandleLike | None = None
    ) -> tuple[GenerateAnswer, str]:
        """Send one /generate request; return (its answer, url of the engine that answered)."""
        if self.router_url is not None:
            return await self._through_router(self.router_url, payload), self.router_url
        handle = engine if engine is not None else await self.pick()
        failed: set[str] = set()
        last_error: EngineError | None = None
        for attempt in range(1, self.max_attempts + 1):
            try:
                response = await self._send_unless_dead(handle, payload)
                if response is not None:
                    return response, handle.url
                # The fleet marked the engine dead (the health monitor saw it hang) while we waited.
                last_error = EngineUnreachable(handle.url, "the fleet marked the engine dead")
            except EngineReplyError as error:  # alive, but its reply is refused: another engine gets it
                last_error = error
                self._refused(handle.url, error, attempt)
                failed.add(handle.url)
                handle = await self.pick(exclude=failed)
                continue
            except EngineHTTPError as error:
                if error.status < 500:
                    raise
                last_error = error
            except EngineError as error:
                last_error = error
            assert self.pool is not None
            # The engine failed this request after the client's own retries: ask the fleet whether it is dead.
            if _still_alive(handle) and await self.pool.check(handle):
                # Alive, but it fails the request (a 5xx, a dropped connection): another engine gets it, as a
                # refused reply's; a request every engine fails ends in NoEngineAvailable naming the counts.
                self._failed_alive(handle.url, last_error, attempt)
                failed.add(handle.url)
                handle = await self.pick(exclude=failed)
                continue
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
        raise NoEngineAvailable(f"request failed on {self.max_attempts} engines in a row (replies refused: "
                                f"{dict(self.refused)}); the last: {last_error}")

    async def _through_router(self, url: str, payload: dict[str, JsonValue]) -> GenerateAnswer:
        """The router balances and retries dead workers itself; a refused reply is re-sent (another worker
        may answer it) up to `max_attempts` times."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await self._send(url, payload)
            except EngineReplyError as error:
                self._refused(url, error, attempt)
        raise NoEngineAvailable(f"the router at {url} gave {self.max_attempts} refused replies in a row")

    async def _send_unless_dead(self, handle: EngineHandleLike,
                                payload: dict[str, JsonValue]) -> GenerateAnswer | None:
        """`_send`, abandoned (None) as soon as the fleet marks `handle` dead: a request blocked on a hung
        (e.g. SIGSTOPped) engine would otherwise wait for the generate timeout instead of being retried."""
        wait_changed = getattr(self.pool, "wait_changed", None)
        if not self.watch_engine_state or wait_changed is None or not hasattr(handle, "alive"):
            return await self._send(handle.url, payload)
        result: GenerateAnswer | None = None
        failure: EngineError | None = None
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                while _still_alive(handle):
                    await wait_changed()
                group.cancel_scope.cancel()

            async def send() -> None:
                # The error is carried out of the task group by hand: raised inside, it would arrive wrapped
                # in an ExceptionGroup that the caller's `except EngineError` does not catch.
                nonlocal result, failure
                try:
                    result = await self._send(handle.url, payload)
                except EngineError as error:
                    failure = error
                group.cancel_scope.cancel()

            group.start_soon(watch)
            group.start_soon(send)
        if failure is not None:
            raise failure
        return result

    async def _send(self, url: str, payload: dict[str, JsonValue]) -> GenerateAnswer:
        self.in_flight[url] += 1
        try:
            answer = await self.client.engine(url).generate(payload)
        finally:
            self.in_flight[url] -= 1
        # A batched request (input_ids is a list of prompts) answers one result per prompt, in order.
        expected = _prompts(payload)
        if len(answer.replies) != expected:
            raise EngineReplyError(url, f"expected {expected} generate result(s), got {len(answer.replies)}")
        return answer

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


def _prompts(payload: dict[str, JsonValue]) -> int:
    """How many prompts a request holds: `input_ids` a list of lists, or `text` a list of strings; else one."""
    ids = payload.get("input_ids")
    text = payload.get("text")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return len(text) if isinstance(text, list) and text else 1
