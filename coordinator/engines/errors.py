"""The engine client's typed errors: the `EngineError` family.

Owns the error classes callers catch. Invariant: callers of the engine client see only `EngineError`
subclasses, never an httpx/aiohttp exception (`transport.py` maps those); this module imports no HTTP
library, so code that only catches engine errors (the node registry, hooks) does not import one.
"""

from __future__ import annotations

from workers.boundary.errors import BoundaryError
from workers.errors import RaylessError

#: the error type our engine answers with while its memory is released (503)
MEMORY_RELEASED = "MemoryReleased"



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


class EngineReplyError(EngineError, BoundaryError):
    """The peer answered 200 with a reply rayless refuses: over its size limit, not bounded JSON, or not the
    shape SGLang gives (float or out-of-vocabulary ids, a NaN logprob, ids and logprobs of different lengths).
    The dispatch treats it like a dead engine's failed request: retried on another engine, counted."""

    def __init__(self, url: str, reason: str) -> None:
        BoundaryError.__init__(self, f"engine {url}", reason)
        self.message = f"engine {url} sent a reply refused: {reason}"
        self.url = url
        self.args = (self.message,)

    def __str__(self) -> str:
        return self.message


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


class EngineStalled(EngineTimeout):
    """A reply stopped moving (`coordinator.engines.stall`): `wait` names what was waited for ("POST /generate"),
    `elapsed` the seconds since the request was sent, `stall` the bound (`--engine-stall-timeout-s`)."""

    def __init__(self, url: str, wait: str, detail: str, *, stall: float, elapsed: float) -> None:
        EngineError.__init__(self, f"engine {url} stalled: {wait} made no progress for {stall:g} s ({detail}); "
                             f"{elapsed:.1f} s since the request was sent", url)
        self.timeout = stall
        self.cause = detail
        self.wait = wait
        self.stall = stall
        self.elapsed = elapsed


class EngineOverdue(EngineTimeout):
    """An engine did not acknowledge a control call (a weight load, a pin) within its deadline
    (`coordinator.engines.deadline`): `wait` names the call ("POST /update_weights_from_disk"), `bound` the
    deadline and the flag that sets it, `elapsed` the seconds waited."""

    def __init__(self, url: str, wait: str, *, bound: float, flag: str, elapsed: float) -> None:
        EngineError.__init__(self, f"engine {url}: {wait} not acknowledged within {bound:g} s ({flag}); "
                             f"{elapsed:.1f} s waited", url)
        self.timeout = bound
        self.cause = f"{wait} overdue"
        self.wait = wait
        self.bound = bound
        self.elapsed = elapsed
