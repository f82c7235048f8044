"""What a training-rank call raises: `RankFailure` (a rank or torchrun died) and `RankCommandError` (a rank
answered with an error); and `ControlPortError`, when the control channel cannot listen where it must.

Owns the error types callers catch (the loop, train FT recovery, the run's error report). Invariant: the rank
errors name the ranks involved, and a failure with a log tail says which log it came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from workers import protocol
from workers.errors import RaylessError


class RankFailure(RaylessError, RuntimeError):
    """One or more training ranks died or disconnected (or torchrun exited)."""

    def __init__(
        self, ranks: Sequence[int], reason: str, *, log_path: Path | None = None, log_tail: str = ""
    ) -> None:
        self.ranks = sorted(set(ranks))
        self.reason = reason
        self.log_path = log_path
        self.log_tail = log_tail
        names = ", ".join(str(rank) for rank in self.ranks) or "unknown"
        message = f"training rank(s) {names} failed: {reason}"
        if log_tail:
            message += f"\n--- last lines of {log_path} ---\n{log_tail}"
        super().__init__(message)


class RankCommandError(RaylessError, RuntimeError):
    """A rank answered a command with an error (its traceback is in the message)."""

    def __init__(self, command: str, errors: dict[int, protocol.Response]) -> None:
        self.command = command
        self.errors = errors
        first_rank = min(errors)
        first = errors[first_rank]
        ranks = ", ".join(str(rank) for rank in sorted(errors))
        message = f"command {command!r} failed on rank(s) {ranks}: {first.error}"
        if first.traceback:
            message += f"\n--- rank {first_rank} traceback ---\n{first.traceback}"
        else:  # the environment's failure (an OSError): the rank logged its traceback
            message += " (the rank's traceback is in its log, train_ranks.log)"
        super().__init__(message)


class ControlPortError(RaylessError, OSError):
    """The control channel cannot listen on its fixed port (`--control-port`)."""
