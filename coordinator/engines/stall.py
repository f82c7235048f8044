"""The engine client's stall detector: a reply that stops moving is an error naming the engine, the wait and the
time waited, long before the request's read timeout (an hour for `/generate`).

Owns two rules, each with the client's `stall_timeout` (`--engine-stall-timeout-s`) as N:
- *body progress*: once an answer's head arrived, its body — and, in a stream, each event line once begun — must
  end or bring `STALL_BYTES` within every N seconds (an honest engine writes a reply, or an event, at once; one
  that drips a byte a second is refused after N s, not after the whole reply's hour);
- *head liveness*: a request whose answer's head has not come after N seconds asks the engine's `/health`
  (one probe per engine at a time, its answer shared by every request waiting on that engine); no answer at all
  within `PROBE_S` — an engine that accepts connections and answers nothing, stopped or wedged — ends the
  request. Any answer, a 503 included, means the server is alive and busy: the request goes on waiting, bounded
  by its read timeout, with one warning line per engine (repeated at doubling waits) naming the engine and the
  wait, so a long wait is never silent. A generation that never finishes on an engine that answers `/health` is
  the HealthMonitor's to find (its probe generates a token; docs/fault-tolerance.md).

Invariant: what either rule ends is an `EngineStalled` (an `EngineTimeout`): the dispatch handles it as any
failed request (the engine is probed, then the request goes to another engine), never retried on the same one.
A probe never changes an engine's state; only the fleet does.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import TYPE_CHECKING

import anyio

from coordinator.engines.errors import EngineStalled

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

#: bytes that count as progress in a body or an event line (a reply's or an event's tail may be shorter: its end
#: counts too)
STALL_BYTES = 64 << 10
#: seconds a `/health` probe of an engine whose answer is late may take; SGLang's own health check answers 503
#: within 20 s (SGLANG_HEALTH_CHECK_TIMEOUT) when its scheduler is busy, so a live server always answers in this
PROBE_S = 30.0


async def progressing(source: AsyncIterator[bytes], *, stall: float, url: str, what: str, started: float,
                      between: Callable[[], bool] = lambda: False) -> AsyncIterator[bytes]:
    """`source`'s chunks, or `EngineStalled` once `stall` seconds pass without `STALL_BYTES` (or the end).

    `between()` says the reader stands between two units (stream events): that wait is the engine's work, not
    a stall, and is bounded by the request's read timeout instead."""
    window_start, window_bytes = time.monotonic(), 0
    iterator = aiter(source)
    while True:
        if between():
            window_start, window_bytes = time.monotonic(), 0
            deadline = math.inf
        else:
            deadline = window_start + stall
        with anyio.move_on_after(deadline - time.monotonic()) as scope:
            try:
                chunk = await anext(iterator)
            except StopAsyncIteration:
                return
        if scope.cancelled_caught:
            now = time.monotonic()
            raise EngineStalled(url, what, f"{window_bytes} bytes in {now - window_start:.1f} s, under "
                                f"{STALL_BYTES} (a reply dripping)", stall=stall, elapsed=now - started)
        window_bytes += len(chunk)
        if window_bytes >= STALL_BYTES:
            window_start, window_bytes = time.monotonic(), 0
        yield chunk


class Liveness:
    """One `/health` probe per engine at a time, its answer reused by every request that asks within `fresh`
    seconds; a late answer is logged once per engine, again at each doubling of the wait."""

    def __init__(self, http: Callable[[], httpx.AsyncClient], *, fresh: float, probe_s: float = PROBE_S) -> None:
        self._http = http
        self.fresh = fresh
        self.probe_s = probe_s
        self._answers: dict[str, tuple[float, bool]] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._warned: dict[str, float] = {}

    async def answers(self, base_url: str) -> bool:
        """Whether the server at `base_url` answers `/health` at all (any status) within `probe_s`."""
        lock = self._locks.setdefault(base_url, anyio.Lock())
        async with lock:
            at, answered = self._answers.get(base_url, (-math.inf, False))
            if time.monotonic() - at < self.fresh:
                return answered
            answered = await self._probe(base_url)
            self._answers[base_url] = (time.monotonic(), answered)
            return answered

    async def _probe(self, base_url: str) -> bool:
        from coordinator.engines.transport import TRANSPORT_ERRORS, request_timeout

        try:
            with anyio.fail_after(self.probe_s + 1):  # the transport's own deadline, and ours should it not hold
                await self._http().get(base_url + "/health", timeout=request_timeout(self.probe_s, self.probe_s))
        except (*TRANSPORT_ERRORS, TimeoutError):
            return False
        return True

    def still_waiting(self, base_url: str, what: str, waited: float, limit: float | None) -> None:
        """One warning per engine, repeated when a wait has doubled since the last one."""
        if waited < 2 * self._warned.get(base_url, 0.0):
            return
        self._warned[base_url] = waited
        bound = f"up to {limit:g} s" if limit is not None else "without a read timeout"
        log.warning("engine %s: %s has had no answer for %.0f s; the engine answers /health (alive, busy): still "
                    "waiting, %s", base_url, what, waited, bound)


async def watch_head(liveness: Liveness, head: anyio.Event, scope: anyio.CancelScope, *, url: str, base_url: str,
                     what: str, stall: float, started: float, limit: float | None,
                     failed: list[EngineStalled]) -> None:
    """Until `head` is set: every `stall` seconds without it, ask whether the engine answers; when it does not,
    record the error in `failed` and cancel `scope` (the request)."""
    while True:
        with anyio.move_on_after(stall):
            await head.wait()
            return
        waited = time.monotonic() - started
        if not await liveness.answers(base_url):
            if head.is_set():
                return
            failed.append(EngineStalled(url, what, f"no answer, and /health gave none within "
                                        f"{liveness.probe_s:g} s (it accepts connections and answers nothing)",
                                        stall=stall, elapsed=time.monotonic() - started))
            scope.cancel()
            return
        liveness.still_waiting(base_url, what, waited, limit)


async def open_watched(stack: AsyncExitStack, opening: AbstractAsyncContextManager[httpx.Response],
                       liveness: Liveness, *, url: str, base_url: str, what: str, stall: float, started: float,
                       limit: float | None) -> httpx.Response:
    """Enter `opening` (an httpx stream: it returns once the answer's head came) on `stack`, the head's wait
    watched by `watch_head` when it may last longer than `stall`; `EngineStalled` when the engine answers
    nothing. The response stays open on `stack` (the watcher's task group ends with the head)."""
    if limit is not None and limit <= stall:
        return await stack.enter_async_context(opening)
    head = anyio.Event()
    failed: list[EngineStalled] = []
    response: httpx.Response | None = None
    error: BaseException | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(functools.partial(watch_head, liveness, head, group.cancel_scope, url=url, base_url=base_url,
                                           what=what, stall=stall, started=started, limit=limit, failed=failed))
        try:
            response = await stack.enter_async_context(opening)
        except Exception as exc:  # carried out by hand: raised here it would come out as an ExceptionGroup
            error = exc
        finally:
            head.set()
    if failed:
        raise failed[0]
    if error is not None:
        raise error
    assert response is not None
    return response
