"""How a failed run is reported: a known failure as one line of its own message; an exception raised by the
user's own code (a reward function, a rollout function, any hook) as one line naming the file and line that
raised it, its traceback going to the run's log file only; anything else, a bug of ours, with its traceback.

Owns `is_user_facing`, the rule for known failures, `user_code_frame`, the rule for the user's code, and
`log_failure`, which applies both. Known failures are `workers.errors.RaylessError` subclasses whose class
says `user_facing`, and `replay`'s `DumpError` family: `replay` imports no package of ours (so it cannot
subclass the base), and the coordinator, which may import `replay`, lists it here by type.

The user's code is found by where it lives, so every hook kind is covered without wrapping each call: walking
a traceback from where it was raised outwards, a frame in a file that is neither ours (the `coordinator`,
`workers` and `replay` packages) nor an installed library (the standard library, site-packages) is theirs;
reaching a frame of ours first means our code (or a library it called) raised. Records meant for the log file
only carry `FILE_ONLY`; `ToFileOnly` keeps them off the terminal, and the records of a library registered with
`file_only_logger` (its own report of a failure rayless reports itself).

A failure the run survives (an agent that raised on one sample) is `ContainedFailures.report`: its traceback in
the log file every time; on the terminal one line the first time for its kind (what failed, the error's type),
then one line with the count at the 10th, 100th, 1000th, ...: a run whose agent fails on many samples says so in
a few lines, not a traceback per sample.
"""

from __future__ import annotations

import logging
import sys
import sysconfig
import traceback
from collections import Counter
from pathlib import Path

import coordinator
import replay
import workers
from workers.errors import RaylessError

#: Set (True) on a log record that belongs in the run's log file but not on the terminal.
FILE_ONLY = "rayless_file_only"


def is_user_facing(error: BaseException) -> bool:
    """True when the message alone tells a person what failed and what to do (printed without traceback)."""
    if isinstance(error, RaylessError):
        return error.user_facing
    from replay.format import DumpError

    return isinstance(error, DumpError)


def failure_line(error: BaseException) -> str:
    """What the run prints for a failure: its kind and its message."""
    return f"{type(error).__name__}: {error}"


def _roots(paths: list[str]) -> tuple[str, ...]:
    resolved = (str(Path(path).resolve()) for path in paths if path)
    return tuple(root + "/" for root in resolved if root != "/")


_OURS = _roots([*coordinator.__path__, *workers.__path__, *replay.__path__])
_LIBRARIES = _roots([sysconfig.get_paths().get(key, "") for key in ("stdlib", "platstdlib", "purelib", "platlib")]
                    + [sys.base_prefix, sys.prefix])


def _origin(filename: str) -> str:
    """"ours", "library" or "user" for a traceback frame's file."""
    if filename.startswith("<"):  # <frozen runpy>, <string>: the interpreter's own
        return "library"
    path = str(Path(filename).resolve())
    if path.startswith(_OURS):
        return "ours"
    if path.startswith(_LIBRARIES) or "/site-packages/" in path or "/dist-packages/" in path:
        return "library"
    return "user"


def user_code_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The frame of the user's code that raised `error` (directly, or through a library it called), else None."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        origin = _origin(frame.filename)
        if origin == "user":
            return frame
        if origin == "ours":
            return None
    return None


def log_failure(log: logging.Logger, error: BaseException) -> None:
    """One error record per failure; its traceback only when it is a bug of ours (in the log file only when it
    is the user's code's)."""
    if is_user_facing(error):
        log.error("run failed: %s", failure_line(error))
        return
    frame = user_code_frame(error)
    if frame is None:
        log.error("run failed: %s", failure_line(error), exc_info=error)
        return
    log.error("run failed: %s, raised by your code at %s:%s (in %s); fix it there (the traceback is in the run's "
              "coordinator.log)", failure_line(error), frame.filename, frame.lineno, frame.name)
    log.error("traceback of the failure above", exc_info=error, extra={FILE_ONLY: True})


_FILE_ONLY_LOGGERS: set[str] = set()
#: the most characters of an error's text on the terminal (a library's error may carry a whole reply)
SUMMARY_CHARS = 240


def file_only_logger(name: str) -> None:
    """The records of logger `name` (and its children) go to the run's log file, not the terminal: a library
    that reports, with its own traceback, a failure that rayless reports in one line. The library's own
    handlers are removed and its records propagate to the run's handlers (verifiers installs a stderr handler
    of its own at import)."""
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True
    _FILE_ONLY_LOGGERS.add(name)


class ToFileOnly(logging.Filter):
    """On a terminal handler: drops the records marked `FILE_ONLY` and those of `file_only_logger`s."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, FILE_ONLY, False):
            return False
        return not any(record.name == name or record.name.startswith(name + ".") for name in _FILE_ONLY_LOGGERS)


def _summary(error: BaseException) -> str:
    text = " ".join(failure_line(error).split())
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


class ContainedFailures:
    """Counts the failures a run survives, by (what failed, the error's type), and reports them: see the module
    docstring. One instance per kind of hook (the agent's)."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.counts: Counter[tuple[str, str]] = Counter()

    def report(self, what: str, where: str, error: BaseException) -> int:
        """`what` failed on `where` (a sample) with `error`, and the run goes on; returns the count of its kind."""
        key = (what, type(error).__name__)
        self.counts[key] += 1
        count = self.counts[key]
        self.log.warning("%s failed on %s: %s", what, where, failure_line(error), exc_info=error,
                         extra={FILE_ONLY: True})
        if count == 1:
            self.log.warning("%s failed on %s: %s (the sample is dropped and the run goes on; every such failure "
                             "is in the run's coordinator.log with its traceback)", what, where, _summary(error))
        elif _is_power_of_ten(count):
            self.log.warning("%s: %d failures with %s so far (each in the run's coordinator.log)", what, count,
                             key[1])
        return count


def _is_power_of_ten(count: int) -> bool:
    while count % 10 == 0 and count > 1:
        count //= 10
    return count == 1
