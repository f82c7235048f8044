"""Waiting on a condition with a deadline: the suite's one way to wait for something another task, thread or
process does.

`wait_until` (in async tests, on anyio) and `wait_until_sync` (in thread and process tests) read `value()`
every `interval` seconds until `until(value)` holds, and return that value. Past `timeout` they raise an
AssertionError naming what was awaited and the last value seen (or the last exception `ignoring` let through),
so a test that times out says why. A predicate may fail fast by raising (e.g. an assert that the process it
waits on is still running): anything not in `ignoring` propagates at once.

Invariant: a wait ends when its condition holds or its deadline passes — never on a fixed sleep.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

_NOTHING = object()


def _timed_out(what: str, timeout: float, last: object) -> AssertionError:
    seen = "nothing (no read finished)" if last is _NOTHING else repr(last)
    return AssertionError(f"timed out after {timeout:g} s waiting for {what}; last seen: {seen}")


async def wait_until(
    value: Callable[[], T | Awaitable[T]],
    *,
    what: str,
    timeout: float,
    until: Callable[[T], object] = bool,
    interval: float = 0.02,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """The first `value()` (awaited if it returns an awaitable) for which `until` holds; AssertionError naming
    `what` and the last value seen after `timeout` seconds (`anyio.fail_after`, which bounds each read too)."""
    last: Any = _NOTHING
    try:
        with anyio.fail_after(timeout) as scope:
            while True:
                try:
                    seen = value()
                    if inspect.isawaitable(seen):
                        seen = await seen
                except ignoring as error:
                    last = error
                else:
                    last = seen
                    if until(seen):  # type: ignore[arg-type]
                        return seen  # type: ignore[return-value]
                await anyio.sleep(interval)
    except TimeoutError:
        if not scope.cancelled_caught:  # a TimeoutError of the read itself
            raise
        raise _timed_out(what, timeout, last) from None


def wait_until_sync(
    value: Callable[[], T],
    *,
    what: str,
    timeout: float,
    until: Callable[[T], object] = bool,
    interval: float = 0.05,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """`wait_until` for code without an event loop (threads, subprocesses): the deadline is checked between
    reads, so a read that blocks is bounded only by its own timeout."""
    deadline = time.monotonic() + timeout
    last: Any = _NOTHING
    while True:
        try:
            seen = value()
        except ignoring as error:
            last = error
        else:
            last = seen
            if until(seen):
                return seen
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last)
        time.sleep(interval)
