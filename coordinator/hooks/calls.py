"""Calling the user's hook code so that neither its blocking nor what it raises decides how the run stops.

Owns `call_hook` (one call of a hook function: a synchronous one runs in a worker thread the run abandons when
it is cancelled, an async one is awaited), `log_escape` (one line on the terminal, the traceback in the run's
log file only) and `HookEscaped`, what comes out of a hook that raised something
other than an `Exception`: `SystemExit`, `KeyboardInterrupt`, `GeneratorExit`, or a `CancelledError` it raised
itself. Each hook kind decides what such an escape costs (rewards and agents: that episode; docs/hooks.md).

Also owns each hook kind's bounds (`HookBounds`, set for a run with `hook_bounds`): a call that has not returned
within its kind's limit ends as `HookTimeout` (a `HookEscaped`: each kind treats it as it treats an escape), and
`max_in_a_row` failures in a row of the same kind (escapes, timeouts, or what the caller reports with
`HookBounds.failed`) raise `HookBudgetSpent`, which stops the run with one line naming the hook, the count and
its last error.

Invariants:
- a stop signal (or any cancellation of the run's scope) ends the wait for a blocked synchronous hook at once,
  with a warning naming the hook; its thread is left behind and ends with the process (`rayless train` exits
  with `os._exit`, which waits for no thread), so a hook stuck in a blocking call never holds the run up;
- a cancellation of ours always propagates; a `CancelledError` the hook raised while nothing of ours was
  cancelled never does (it would end a task silently, as if its work were done: a sample with no tokens);
- an ordinary `Exception` from the hook comes out unchanged (each hook kind's own contract);
- no call waits longer than its kind's limit: the wait ends and a synchronous hook's thread is abandoned;
- a failure count only grows across calls that all failed: one call that returned (and that its caller did not
  report as failed) resets its kind's count.
A synchronous hook that blocks the event loop from an `async def` (time.sleep in a coroutine) cannot be helped
here: nothing of ours runs until it returns.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from coordinator.hooks.runtime import HookError
from coordinator.lifecycle.failures import FILE_ONLY

log = logging.getLogger("rayless")


class HookEscaped(HookError):
    """A hook raised what is not an `Exception` (exit, interrupt, its own CancelledError): `original` holds it."""

    def __init__(self, what: str, original: BaseException) -> None:
        super().__init__(f"{what} raised {type(original).__name__}({_args(original)}), which is not an Exception")
        self.what = what
        self.original = original


class HookTimeout(HookEscaped):
    """A hook call did not return within its kind's limit; `original` is a TimeoutError saying so."""

    def __init__(self, what: str, limit: float, flag: str) -> None:
        original = TimeoutError(f"no return within {limit:g} s ({flag})")
        HookError.__init__(self, f"{what} did not return within {limit:g} s ({flag})")
        self.what = what
        self.original = original
        self.limit = limit


class HookBudgetSpent(HookError):
    """The same hook kind failed `count` calls in a row: the run stops. Never caught by a hook kind's own
    handling of a failed episode."""

    def __init__(self, what: str, count: int, last: BaseException | str) -> None:
        # an escape or a timeout already names the hook and what it raised; another error is named by its type
        text = last if isinstance(last, str | HookError) else f"{type(last).__name__}: {last}"
        super().__init__(f"{what} failed {count} times in a row (--hook-max-failures-in-a-row); last: {text}")
        self.what = what
        self.count = count


#: hook kind -> the flag that bounds one call of it
LIMIT_FLAGS: Mapping[str, str] = {
    "agent": "--agent-timeout-s",
    "generate": "--custom-generate-timeout-s",
    "reward": "--custom-rm-timeout-s",
    "filter": "--dynamic-sampling-filter-timeout-s",
    "rollout": "--rollout-function-timeout-s",
}
#: each kind's default limit in seconds (the flags' defaults; docs/hooks.md's table states them)
DEFAULT_LIMITS: Mapping[str, float] = {"agent": 1800.0, "generate": 3600.0, "reward": 300.0, "filter": 60.0,
                                       "rollout": 7200.0}
DEFAULT_MAX_IN_A_ROW = 64


@dataclass
class HookBounds:
    """One run's limits per hook kind and its counts of failures in a row (one count per kind)."""

    limits: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    max_in_a_row: int = DEFAULT_MAX_IN_A_ROW
    in_a_row: dict[str, int] = field(default_factory=dict)
    #: the traceback of a failure is logged once per kind (the next ones are one line each)
    _traced: set[str] = field(default_factory=set)
    #: the kinds whose budget is spent (HookBudgetSpent raised)
    _spent: set[str] = field(default_factory=set)

    def limit(self, kind: str) -> float:
        return self.limits.get(kind, DEFAULT_LIMITS[kind])

    def failed(self, kind: str, what: str, error: BaseException | str) -> None:
        """Count a failed call of `kind`; raise HookBudgetSpent when it makes `max_in_a_row`."""
        count = self.in_a_row.get(kind, 0) + 1
        self.in_a_row[kind] = count
        if isinstance(error, BaseException) and kind not in self._traced:
            self._traced.add(kind)
            log.warning("traceback of the first failure of %s", what, exc_info=error, extra={FILE_ONLY: True})
        if count >= self.max_in_a_row and kind not in self._spent:
            # Once per kind: calls failing at the same moment (timeouts of one deadline) would each stop the run
            # with a line of their own; after the first, a failure is an ordinary failed call while the run stops.
            self._spent.add(kind)
            raise HookBudgetSpent(what, count, error)

    def returned(self, kind: str) -> None:
        """A call of `kind` returned what its caller could use: its count of failures in a row starts over."""
        self.in_a_row[kind] = 0


_BOUNDS: contextvars.ContextVar[HookBounds] = contextvars.ContextVar("rayless_hook_bounds")


@contextmanager
def hook_bounds(bounds: HookBounds) -> Iterator[HookBounds]:
    """Use `bounds` for every hook call made from this context (and the tasks and threads it starts)."""
    token = _BOUNDS.set(bounds)
    try:
        yield bounds
    finally:
        _BOUNDS.reset(token)


def current_bounds() -> HookBounds:
    """This run's bounds; outside a run (a unit test, a tool), fresh defaults for this context."""
    bounds = _BOUNDS.get(None)
    if bounds is None:
        bounds = HookBounds()
        _BOUNDS.set(bounds)
    return bounds


def log_escape(escaped: HookEscaped, consequence: str) -> None:
    """One warning line (the escape and what it cost); the hook's traceback goes to the run's log file only."""
    log.warning("%s: %s (its traceback is in the run's coordinator.log)", escaped, consequence)
    log.warning("traceback of the escape above", exc_info=escaped.original, extra={FILE_ONLY: True})


def _args(error: BaseException) -> str:
    return ", ".join(repr(arg) for arg in error.args)[:120]


async def cancelled_here() -> bool:
    """Whether a cancel scope around this task is cancelled now (the run stopping), rather than a cancellation
    exception having been raised by someone's code while nothing was cancelled."""
    try:
        await anyio.lowlevel.checkpoint_if_cancelled()
    except anyio.get_cancelled_exc_class():
        return True
    return False


def _in_thread(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, BaseException | None]:
    """(result, None), or (None, what the hook raised that is not an Exception): such an exception does not cross
    back to the event loop as itself (a GeneratorExit re-raised in a coroutine breaks it; a CancelledError would
    read as ours)."""
    try:
        return fn(*args, **kwargs), None
    except Exception:
        raise
    except BaseException as error:
        return None, error


async def call_hook(fn: Callable[..., Any], *args: Any, what: str, kind: str, counted: bool = True,
                    **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, awaited when it returns an awaitable, within `kind`'s limit (`HookBounds`). `what`
    names the hook in messages ("--custom-rm-path my.rm"). A synchronous `fn` runs in a worker thread (the
    hook-call context, and slime's `run(coro)`, work there); cancelled or past its limit, the wait ends at once
    and the thread is abandoned. An escape or a timeout counts as a failure of `kind` (`HookBudgetSpent` once
    the budget is spent, else `HookEscaped`/`HookTimeout`); a return resets the count unless `counted=False`
    (the caller judges the result and reports it: `current_bounds().failed/returned`). An ordinary
    `Exception` is the hook kind's own contract and is not counted here."""
    bounds = current_bounds()
    limit = bounds.limit(kind)
    deadline = anyio.CancelScope(deadline=anyio.current_time() + limit)
    try:
        with deadline:
            result = await _call(fn, args, kwargs, what, deadline)
        if deadline.cancelled_caught:
            raise HookTimeout(what, limit, LIMIT_FLAGS[kind])
    except HookEscaped as escaped:
        bounds.failed(kind, what, escaped)
        raise
    if counted:
        bounds.returned(kind)
    return result


async def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], what: str,
                deadline: anyio.CancelScope) -> Any:
    synchronous = not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)))  # noqa: B004
    started = time.monotonic()
    try:
        if synchronous:
            result, escaped = await anyio.to_thread.run_sync(functools.partial(_in_thread, fn, args, kwargs),
                                                             abandon_on_cancel=True)
            if escaped is not None:
                raise HookEscaped(what, escaped) from escaped
        else:
            result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result
    except Exception:
        raise
    except anyio.get_cancelled_exc_class() as error:
        if not await cancelled_here():
            raise HookEscaped(what, error) from error
        if synchronous and not deadline.cancel_called:
            log.warning("stopping: %s was still running after %.1f s (a blocking call in a worker thread); it is "
                        "left behind and ends with the process", what, time.monotonic() - started)
        raise
    except BaseException as error:  # SystemExit, KeyboardInterrupt, GeneratorExit: the hook's, never ours
        raise HookEscaped(what, error) from error
