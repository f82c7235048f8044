"""The orphan check, a pytest plugin: the test session must leave no child process behind.

Every test that starts an engine, router, torchrun or rank must end it on every exit path. The check is the
teardown of a session-scoped autouse fixture, so it runs after every other test and fixture whatever the
collection order, the selection (`tests/unit`, `-k`, one file) or an early stop (`-x`); a survivor fails
the run as an error at teardown of the last test, naming each leftover's command line.
`tests/conftest.py` loads it; `tests/integration/test_orphan_check.py` shows it failing a session that leaks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psutil
import pytest

from tests.support.waiting import wait_until_sync

GRACE_S = 5.0


def live_children() -> list[psutil.Process]:
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            continue  # exited (and reaped) between the listing and the look
    return alive


def assert_no_child_processes_left() -> None:
    # A child ended by the last test may still be on its way out: allow a short grace.
    with contextlib.suppress(AssertionError):  # those still running are named below
        wait_until_sync(live_children, until=lambda left: not left, timeout=GRACE_S, interval=0.1,
                        what="the suite's child processes to exit")
    alive = live_children()
    described = []
    for p in alive:
        try:
            described.append(f"pid {p.pid}: {' '.join(p.cmdline())}")
        except psutil.Error:
            described.append(f"pid {p.pid}")
    assert not alive, "child processes left by the test suite:\n" + "\n".join(described)


@pytest.fixture(scope="session", autouse=True)
def no_orphans_at_session_end() -> Iterator[None]:
    # Set up before any other fixture, so torn down after all of them (module-scoped engines included).
    yield
    assert_no_child_processes_left()
