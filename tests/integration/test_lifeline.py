"""The lifeline (`workers/lifeline.py`, started by `coordinator.lifecycle.processes.spawn_group_leader`) with real
processes: a stand-in coordinator launches children through it and is SIGKILLed; its children, their helpers
in the same group and in sessions of their own, and a child that ignores SIGTERM all end by themselves.
While the coordinator lives nothing fires, and the coordinator's own stop leaves no watcher behind.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from coordinator.lifecycle.processes import (
    ORPHAN_GRACE_S,
    exit_status,
    spawn_group_leader,
    terminate_process_group_blocking,
)
from tests.support.processes import alive
from tests.support.waiting import wait_until_sync

#: A child with two helpers: one in its process group, one in a session of its own (as torchrun's ranks).
CHILD = """
import subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
subprocess.Popen(sleeper)
subprocess.Popen(sleeper, start_new_session=True)
time.sleep(600)
"""

#: A child that ignores SIGTERM: only the watcher's SIGKILL after the grace period ends it.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"

#: The stand-in coordinator: launches both children, writes their pids, then waits to be killed.
COORDINATOR = """
import json, sys, time
from coordinator.lifecycle.processes import spawn_group_leader
log = open(sys.argv[1], "ab")
children = [spawn_group_leader([sys.executable, "-c", code], log=log) for code in json.loads(sys.argv[2])]
print(json.dumps([child.pid for child in children]), flush=True)
time.sleep(600)
"""


def descendants(pid: int) -> list[psutil.Process]:
    return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]


def test_children_of_a_killed_coordinator_end_with_their_helpers(tmp_path: Path) -> None:
    log = tmp_path / "children.log"
    coordinator = subprocess.Popen([sys.executable, "-c", COORDINATOR, str(log), json.dumps([CHILD, STUBBORN])],
                                   stdout=subprocess.PIPE, text=True)
    processes: list[psutil.Process] = []
    try:
        assert coordinator.stdout is not None
        pids = json.loads(coordinator.stdout.readline())
        # CHILD: its watcher and two helpers; STUBBORN: its watcher.
        wait_until_sync(lambda: [len(psutil.Process(pid).children(recursive=True)) for pid in pids],
                        until=lambda counts: counts == [3, 1], timeout=60, what="each child's watcher and helpers")
        processes = [process for pid in pids for process in descendants(pid)]
        assert len(alive(processes)) == 6
        coordinator.kill()
        coordinator.wait()
        # The stubborn child ignores SIGTERM: gone means the watcher's SIGKILL after the grace period came.
        wait_until_sync(lambda: alive(processes), until=lambda left: not left, timeout=ORPHAN_GRACE_S + 5,
                        what="every child and helper gone once the coordinator is")
    finally:
        for process in alive(processes):
            process.kill()
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.wait()
        assert coordinator.stdout is not None
        coordinator.stdout.close()
    assert log.read_text().count("rayless: the coordinator is gone; stopping process group") == 2


def test_while_the_coordinator_lives_nothing_fires_and_a_stop_leaves_no_watcher(tmp_path: Path) -> None:
    with open(tmp_path / "child.log", "ab") as log:
        child = spawn_group_leader([sys.executable, "-c", "import time; time.sleep(600)"], log=log)
    try:
        wait_until_sync(lambda: psutil.Process(child.pid).children(), timeout=30, what="the child's watcher")
        processes = descendants(child.pid)
        assert [p.cmdline()[-1] for p in processes] == ["import time; time.sleep(600)"] * 2  # child, watcher
        time.sleep(1.0)  # the thing tested: an idle second of a live coordinator, in which the watcher must not fire
        assert exit_status(child) is None and len(alive(processes)) == 2
    finally:
        terminate_process_group_blocking(child, grace=5.0)
    assert child.returncode == -signal.SIGTERM
    wait_until_sync(lambda: alive(processes), until=lambda left: not left, timeout=5,
                    what="the child and its watcher gone after the stop")
    assert "coordinator is gone" not in (tmp_path / "child.log").read_text()


def test_a_command_that_cannot_run_exits_127_saying_why(tmp_path: Path) -> None:
    path = tmp_path / "child.log"
    with open(path, "ab") as log:
        child = spawn_group_leader([str(tmp_path / "no-such-program"), "--flag"], log=log)
    try:
        child.wait(timeout=30)
    finally:
        terminate_process_group_blocking(child, grace=1.0)
    assert child.returncode == 127
    assert f"rayless: cannot run {str(tmp_path / 'no-such-program')!r}: No such file or directory" in path.read_text()
