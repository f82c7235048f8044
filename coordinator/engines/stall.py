"""The engine client's stall detector: a reply that stops moving is an error naming the engine, the wait and the
time waited, long before the request's read timeout (an hour for `/generate`).

Owns three rules, each with the client's `stall_timeout` (`--engine-stall-timeout-s`) as N:
- *body progress*: once an answer's head arrived, its body — and, in a stream, each event line once begun — must
  end or bring `STALL_BYTES` within every N seconds (an honest engine writes a reply, or an event, at once; one
  that drips a byte a second is refused after N s, not after the whole reply's hour);
- *head liveness* (`HeadWatch`, a service of the run): a request whose answer's head has not come after N
  seconds (looked for every quarter of N) gets its engine asked for `/health` (one probe per engine, its
  answer shared by every request waiting on that engine); no answer at all within `PROBE_S` — an engine that
  accepts connections and answers nothing, stopped or wedged — ends the engine's late requests. Any answer, a
  503 included, means the server is alive and busy: the request goes on waiting, bounded by its read timeout, with one warning line per engine (repeated at doubling waits) naming the engine and the
  wait, so a long wait is never silent. A generation that never finishes on an engine that answers `/health` is
  the HealthMonitor's to find (its probe generates a token; docs/fault-tolerance.md).

One cancel scope per request carries both rules (`ReplyClock`): no deadline while the head is awaited (the watch
cancels it), then the body's, moved on at each `STALL_BYTES`; a stream's lines, read by a generator that yields
between them, go through `progressing` instead.

Invariant: what any rule ends is an `EngineStalled` (an `EngineTimeout`): the dispatch handles it as any
failed request (the engine is probed, then the request goes to another engine), never retried on the same one.
A probe never changes an engine's state; only the fleet does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio
import anyio.abc

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


class ReplyClock:
    """Both rules for one request in one cancel scope: registered with `watch` while the head is awaited (when
    the request's read timeout is longer than the stall bound), then, after `headed()`, the body's deadline,
    moved on by `advance`. Leaving it cancelled raises `EngineStalled` (the watch's, or the body's)."""

    def __init__(self, *, stall: float, url: str, base_url: str, what: str, started: float,
                 watch: HeadWatch | None, limit: float | None, answer_by: tuple[float, str] | None = None) -> None:
        self.stall, self.url, self.base_url, self.what, self.started, self.limit = stall, url, base_url, what, \
            started, limit
        self._watch = watch if watch is not None and (limit is None or limit > stall) else None
        #: the generation bound (seconds of the engine's unpaused time, and how it was derived), when it is
        #: shorter than the read timeout
        self.answer_by = answer_by if answer_by is not None and (limit is None or answer_by[0] < limit) else None
        self.paused_before = self._watch.paused(self.base_url) if self._watch is not None else 0.0
        self._scope = anyio.CancelScope()
        self._window_start = started
        self._bytes = 0
        #: set by the watch when the engine answered nothing
        self.failed: EngineStalled | None = None

    def headed(self) -> None:
        """The answer's head came: from now on its body must move."""
        if self._watch is not None:
            self._watch.waiting.discard(self)
        self._window_start, self._bytes = time.monotonic(), 0
        self._scope.deadline = anyio.current_time() + self.stall

    def advance(self, size: int) -> None:
        """`size` more bytes of the body came."""
        self._bytes += size
        if self._bytes >= STALL_BYTES:
            self._window_start, self._bytes = time.monotonic(), 0
            self._scope.deadline = anyio.current_time() + self.stall

    def stop(self, failed: EngineStalled) -> None:
        """The watch's verdict: the engine answers nothing."""
        self.failed = failed
        self._scope.cancel()

    def __enter__(self) -> ReplyClock:
        self._scope.__enter__()
        if self._watch is not None:
            self._watch.waiting.add(self)
        return self

    def __exit__(self, *exc_info: object) -> bool:
        if self._watch is not None:
            self._watch.waiting.discard(self)
        suppressed = bool(self._scope.__exit__(*exc_info))  # type: ignore[arg-type]
        if self._scope.cancelled_caught:
            if self.failed is not None:
                raise self.failed
            now = time.monotonic()
            raise EngineStalled(self.url, self.what, f"{self._bytes} bytes in {now - self._window_start:.1f} s, "
                                f"under {STALL_BYTES} (a reply dripping)", stall=self.stall,
                                elapsed=now - self.started)
        return suppressed


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


class HeadWatch:
    """The head-liveness rule for every request of one client: the requests register while they wait for an
    answer's head (a dict entry and a cancel scope: no task per request), and `run` — a service the run starts
    — looks every quarter of `stall` for those waiting longer than `stall`, probes their engines (one probe per
    engine, concurrently) and ends the requests of an engine that answered nothing. A client whose watch is not
    running (a hook's own client, a tool) keeps the body rule and its read timeouts."""

    def __init__(self, liveness: Liveness, stall: float,
                 paused: Callable[[str], float] = lambda base_url: 0.0) -> None:
        self.liveness = liveness
        self.stall = stall
        #: seconds an engine has spent paused for weight updates so far (the client's ledger)
        self.paused = paused
        self.tick = min(stall / 4, 5.0)
        #: the requests awaiting their answer's head (each `ReplyClock` adds and removes itself)
        self.waiting: set[ReplyClock] = set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await anyio.sleep(self.tick)
            await self.sweep()

    async def sweep(self) -> None:
        """End every request past its generation bound; judge every engine with a request waiting longer than
        `stall` for its head."""
        now = time.monotonic()
        late: dict[str, list[ReplyClock]] = {}
        for waiting in list(self.waiting):
            if waiting.failed is not None:
                continue
            if waiting.answer_by is not None:
                paused = self.paused(waiting.base_url) - waiting.paused_before
                bound, derived = waiting.answer_by
                if now - waiting.started - paused >= bound:
                    held = f", {paused:.1f} s of it paused for a weight update (not counted)" if paused else ""
                    waiting.stop(EngineStalled(
                        waiting.url, waiting.what, f"no answer within {bound:g} s, the bound of its request: "
                        f"{derived}{held}", stall=bound, elapsed=now - waiting.started))
                    continue
            if now - waiting.started >= self.stall:
                late.setdefault(waiting.base_url, []).append(waiting)
        async with anyio.create_task_group() as group:
            for base_url, requests in late.items():
                group.start_soon(self._judge, base_url, requests)

    async def _judge(self, base_url: str, requests: list[ReplyClock]) -> None:
        if await self.liveness.answers(base_url):
            oldest = min(requests, key=lambda waiting: waiting.started)
            limit = oldest.answer_by[0] if oldest.answer_by is not None else oldest.limit
            self.liveness.still_waiting(base_url, oldest.what, time.monotonic() - oldest.started, limit)
            return
        for waiting in requests:
            if waiting in self.waiting:  # not answered meanwhile
                waiting.stop(EngineStalled(
                    waiting.url, waiting.what, f"no answer, and /health gave none within {self.liveness.probe_s:g} s "
                    "(it accepts connections and answers nothing)", stall=self.stall,
                    elapsed=time.monotonic() - waiting.started))
