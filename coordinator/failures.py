"""How a failed run is reported: a known failure as one line of its own message, anything else with its
traceback.

Owns `is_user_facing`, the one rule, and `log_failure`, which applies it. Known failures are `workers.errors.RaylessError` subclasses whose class
says `user_facing`, and `replay`'s `DumpError` family: `replay` imports no package of ours (so it cannot
subclass the base), and the coordinator, which may import `replay`, lists it here by type.
"""

from __future__ import annotations

import logging

from workers.errors import RaylessError


def is_user_facing(error: BaseException) -> bool:
    """True when the message alone tells a person what failed and what to do (printed without traceback)."""
    if isinstance(error, RaylessError):
        return error.user_facing
    from replay.format import DumpError

    return isinstance(error, DumpError)


def failure_line(error: BaseException) -> str:
    """What the run prints for a failure: its kind and its message."""
    return f"{type(error).__name__}: {error}"


def log_failure(log: logging.Logger, error: BaseException) -> None:
    """One error record per failure; its traceback only when it is not a known failure."""
    log.error("run failed: %s", failure_line(error), exc_info=None if is_user_facing(error) else error)
