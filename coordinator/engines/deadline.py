"""A control call to an engine under a deadline that names it: `acknowledged(url, wait, bound, flag)`.

Owns the one way a wait on an engine's acknowledgment (a weight load, an eval pin's load or version check) is
bounded: an `anyio.fail_after` of `bound` seconds around the call, its expiry turned into `EngineOverdue`
naming the engine, the call, the bound with the flag that sets it, and the time waited. The call's own read
timeout should be a little longer than `bound` (`read_timeout`), so this deadline, not the transport's, is
what a silent engine meets.

Invariant: a call under `acknowledged` returns, raises its own `EngineError`, or raises `EngineOverdue` at
`bound` seconds — never later, whatever the transport or the retry policy would do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from coordinator.engines.errors import EngineOverdue

#: seconds a call's read timeout exceeds its deadline, so the deadline ends it first
MARGIN_S = 5.0


def read_timeout(bound: float) -> float:
    """The read timeout for a call under a deadline of `bound` seconds."""
    return bound + MARGIN_S


@contextmanager
def acknowledged(url: str, wait: str, *, bound: float, flag: str) -> Iterator[None]:
    """Run the block within `bound` seconds, or raise `EngineOverdue(url, wait, ...)`."""
    started = time.monotonic()
    try:
        with anyio.fail_after(bound):
            yield
    except TimeoutError:
        raise EngineOverdue(url, wait, bound=bound, flag=flag, elapsed=time.monotonic() - started) from None
