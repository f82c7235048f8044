"""slime's `run(coro)` (`slime.utils.async_utils.run`) for synchronous hook code: a coroutine run on the run's
event loop from one of its worker threads, or on a new loop elsewhere."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import anyio
import anyio.from_thread

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """slime's `run(coro)`: run a coroutine from synchronous hook code. In a slime-style rollout function
    (a worker thread of the run) it runs on the run's event loop; elsewhere on a new loop."""

    async def wait() -> T:
        return await coro

    try:
        return anyio.from_thread.run(wait)
    except RuntimeError as error:
        if "worker thread" not in str(error) and "event loop" not in str(error):
            raise
    return anyio.run(wait)
