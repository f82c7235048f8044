"""Calling the user's hook code so that neither its blocking nor what it raises decides how the run stops.

Owns `call_hook` (one call of a hook function: a synchronous one runs in a worker thread the run abandons when
it is cancelled, an async one is awaited), `log_escape` (one line on the terminal, the traceback in the run's
log file only) and `HookEscaped`, what comes out of a hook that raised something
other than an `Exception`: `SystemExit`, `KeyboardInterrupt`, `GeneratorExit`, or a `CancelledError` it raised
itself. Each hook kind decides what such an escape costs (rewards and agents: that episode; docs/hooks.md).

Invariants:
- a stop signal (or any cancellation of the run's scope) ends the wait for a blocked synchronous hook at once,
  with a warning naming the hook; its thread is left behind and ends with the process (`rayless train` exits
  with `os._exit`, which waits for no thread), so a hook stuck in a blocking call never holds the run up;
- a cancellation of ours always propagates; a `CancelledError` the hook raised while nothing of ours was
  cancelled never does (it would end a task silently, as if its work were done: a sample with no tokens);
- an ordinary `Exception` from the hook comes out unchanged (each hook kind's own contract).
A synchronous hook that blocks the event loop from an `async def` (time.sleep in a coroutine) cannot be helped
here: nothing of ours runs until it returns.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
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


async def call_hook(fn: Callable[..., Any], *args: Any, what: str, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, awaited when it returns an awaitable. `what` names the hook in messages
    ("--custom-rm-path my.rm"). A synchronous `fn` runs in a worker thread (the hook-call context, and slime's
    `run(coro)`, work there); cancelled, the wait ends at once and the thread is abandoned."""
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
        if synchronous:
            log.warning("stopping: %s was still running after %.1f s (a blocking call in a worker thread); it is "
                        "left behind and ends with the process", what, time.monotonic() - started)
        raise
    except BaseException as error:  # SystemExit, KeyboardInterrupt, GeneratorExit: the hook's, never ours
        raise HookEscaped(what, error) from error
