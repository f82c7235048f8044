"""Runs last (by file name): the test session must leave no child process behind.

Every test that starts an engine, router, torchrun or rank must end it on every exit path; a survivor here
names the test suite's leak (its command line is in the failure message).
"""

from __future__ import annotations

import time

import psutil


def live_children() -> list[psutil.Process]:
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            continue  # exited (and reaped) between the listing and the look
    return alive


def test_no_child_processes_left() -> None:
    # A child ended by the test before this one may still be on its way out: allow a short grace.
    deadline = time.monotonic() + 5.0
    alive = live_children()
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = live_children()
    described = []
    for p in alive:
        try:
            described.append(f"pid {p.pid}: {' '.join(p.cmdline())}")
        except psutil.Error:
            described.append(f"pid {p.pid}")
    assert not alive, "child processes left by the test suite:\n" + "\n".join(described)
