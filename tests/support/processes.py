"""Which of a run's processes still run, and the bound a stopped run's processes must be gone within.

Owns `alive` (the processes of a list still running: zombies and vanished ones are not) and `wait_gone`, shared by
the tests that stop or kill a run and check that nothing it launched is left, and `STOP_BOUND_S`. Invariant: it
only reads `/proc` (through psutil) and waits; it never signals a process.
"""

from __future__ import annotations

import contextlib

import psutil

from tests.support.waiting import wait_until_sync

#: How long after a stop (a signal to the coordinator) a process of the run may still run: what the code
#: enforces, not what a stop takes. The ranks get 5 s to answer their shutdown command, torchrun 5 s to exit,
#: then SIGTERM and SIGKILL 5 s later and a 5 s sweep (`coordinator/train/torchrun.py`); the engines' 10 s stop
#: grace and sweep and the router's run beside it: 20 s, and 10 s for the coordinator's own exit on a loaded
#: machine. A process left after that is a leak, not a slow machine. How long a stop takes (5–9 s on two loaded
#: cores; docs/running.md's "about 10 s") is a timing, measured and checked by `bench/soak.py`.
STOP_BOUND_S = 30.0


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running (psutil.Process keeps each one's identity: a reused pid is not it)."""
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
        except psutil.NoSuchProcess:
            continue
    return left


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still alive after waiting up to `timeout` for all to be gone (the caller asserts)."""
    with contextlib.suppress(AssertionError):
        wait_until_sync(lambda: alive(processes), until=lambda left: not left, timeout=timeout, interval=0.1,
                        what="the run's processes gone")
    return alive(processes)
