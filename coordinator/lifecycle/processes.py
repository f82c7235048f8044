"""The child processes the coordinator launches (engines, the router, torchrun), and how they end.

Owns, once for every launcher: starting a child as the leader of its own process group, through the lifeline,
with its output in a log file; seeing that it exited without reaping it; ending its whole group and descendants
(SIGTERM, SIGKILL after a grace period, sweep, reap); the log tail of an error (`with_log_tail`); flattening the
exception groups of concurrent starts. Why `Popen` and the lifeline: docs/fault-tolerance.md.

Invariants:
  * A child leads its own process group, so one `killpg` reaches it and the helpers that stayed in its group;
    `terminate_process_group` also ends the leader's descendants (torchrun's ranks start sessions of their own).
  * A child ends by itself when the coordinator is gone, however it went; so the coordinator never forks without
    exec (a forked copy would hold the lifeline's write end open).
  * A child is reaped only by `terminate_process_group`, after the last `killpg` of its group (`waitid(WNOWAIT)`
    checks exits), so its group id is never reused while we may signal it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

import anyio

from workers import lifeline

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup
if TYPE_CHECKING:
    import psutil


#: `workers/lifeline.py`, run by path with `-I` so that it needs nothing of the child's environment.
LIFELINE_SCRIPT = lifeline.__file__

#: Seconds a child's watcher gives its group to exit on SIGTERM, once the coordinator is gone, before SIGKILL.
ORPHAN_GRACE_S = 3.0

_lifeline: tuple[int, int] | None = None  # (read end, write end), made once per coordinator process


def lifeline_fd() -> int:
    """The read end of this process's lifeline pipe (see the module's invariants), made on first use."""
    global _lifeline
    if _lifeline is None:
        _lifeline = os.pipe()  # both ends close-on-exec; `pass_fds` hands the read end to each child
    return _lifeline[0]


def lifeline_command(command: Sequence[str]) -> list[str]:
    """`command` run through the lifeline (the pid stays `command`'s: the wrapper execs it)."""
    return [sys.executable, "-I", LIFELINE_SCRIPT, str(lifeline_fd()), str(ORPHAN_GRACE_S), "--", *command]


def spawn_group_leader(
    command: Sequence[str], *, log: IO[bytes], env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start `command` leading its own process group, stdout and stderr into `log`, no stdin, on the
    lifeline (it ends by itself once this process is gone). A command that cannot be run exits with 127 and
    says why in `log`.

    Blocking only until the child has exec'd, so async callers call it directly.
    """
    return subprocess.Popen(
        lifeline_command(command),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(env) if env is not None else None,
        start_new_session=True,
        pass_fds=(lifeline_fd(),),
    )


def exit_status(proc: subprocess.Popen[bytes]) -> int | None:
    """The exit status if `proc` has exited (negative: killed by that signal), else None. Never reaps."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


async def wait_exited(proc: subprocess.Popen[bytes], poll_s: float = 0.1) -> int:
    """Wait until `proc` exits (without reaping it) and return its exit status. Bound it with a cancel scope."""
    while (code := exit_status(proc)) is None:  # noqa: ASYNC110 - no exit event short of SIGCHLD handlers
        await anyio.sleep(poll_s)
    return code


async def terminate_process_group(proc: subprocess.Popen[bytes], grace: float) -> int:
    """End `proc`'s process group: SIGTERM, SIGKILL after `grace` seconds, sweep leftovers, reap. Shielded.

    `proc` must lead its own group (see `spawn_group_leader`) and not be reaped yet. Returns its exit status.
    """
    with anyio.CancelScope(shield=True):
        for pause in _terminate_steps(proc, grace):
            await anyio.sleep(pause)
    return proc.returncode


def terminate_process_group_blocking(proc: subprocess.Popen[bytes], grace: float) -> int:
    """`terminate_process_group` for code with no event loop (the test and bench helpers)."""
    for pause in _terminate_steps(proc, grace):
        time.sleep(pause)
    return proc.returncode


def _terminate_steps(proc: subprocess.Popen[bytes], grace: float) -> Iterator[float]:
    """Ending a process group, step by step; yields how long to pause between checks, so the one sequence
    serves async and blocking callers (no event exists for a child's exit short of SIGCHLD handlers)."""
    import psutil  # here, not at the top: `coordinator.run` imports this module and starts faster without it

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)  # helpers that left the group
    except psutil.Error:
        descendants = []
    if exit_status(proc) is None:
        _killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while exit_status(proc) is None and time.monotonic() < deadline:
            yield 0.05
    # The leader is exited but not reaped, so its pgid is still ours: sweep the whole group.
    _killpg(proc.pid, signal.SIGKILL)
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass
    # A SIGKILLed process takes a moment to die: "stopped" means that none runs any more (the lifeline's
    # watcher included), so wait for that, briefly, before reaping the leader (which frees its pgid).
    deadline = time.monotonic() + _SWEEP_WAIT_S
    while _still_running(proc.pid, descendants) and time.monotonic() < deadline:
        yield 0.02
    while proc.poll() is None:  # SIGKILLed: reaped within milliseconds
        yield 0.02


#: How long `terminate_process_group` waits for SIGKILLed processes to be gone (they die in milliseconds).
_SWEEP_WAIT_S = 5.0


def _still_running(pgid: int, descendants: list[psutil.Process]) -> bool:
    """Whether a process of group `pgid`, or one of `descendants`, is still running (zombies are not)."""
    import psutil

    candidates = list(descendants)
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid:
                candidates.append(psutil.Process(pid))
        except (OSError, psutil.Error):
            continue
    for process in candidates:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.Error:
            continue
    return False


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def read_tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last `lines` lines of a log (read from its last `max_bytes`); "" when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def with_log_tail(message: str, log_path: Path | None, tail: str) -> str:
    """A failure's message followed by the last lines of the failed process's log, the same way for every
    launched process (engines, ranks, the router)."""
    if not tail:
        return message
    return f"{message}\n--- last lines of {log_path} ---\n{tail}"


def leaf_exceptions(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; a plain exception is its own only leaf."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaf_exceptions(inner)]
    return [error]
