"""`rayless stacks` (coordinator/observe/stacks.py, workers/stack_dumps.py) against real processes: a
registered process answers SIGUSR1 with every thread's stack, even while blocked; a process that did not
register is never signalled (SIGUSR1 would end it); a run with nothing live is said so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.observe.stacks import collect, main
from workers.stack_dumps import ENV_STACKS_DIR

REPO = Path(__file__).resolve().parents[2]

REGISTERED = """
import sys, time
from workers import stack_dumps
stack_dumps.install("rank0")

def waiting_for_a_collective():
    print("ready", flush=True)
    time.sleep(120)

waiting_for_a_collective()
"""


def start(script: str, stacks: Path) -> subprocess.Popen[str]:
    env = {**os.environ, ENV_STACKS_DIR: str(stacks), "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)


def test_a_registered_process_answers_and_a_stranger_is_left_alone(tmp_path: Path) -> None:
    stacks = tmp_path / "stacks"
    rank = start(REGISTERED, stacks)
    stranger = start("import time\nprint('ready', flush=True)\ntime.sleep(120)\n", stacks)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        assert stranger.stdout is not None and stranger.stdout.readline().strip() == "ready"
        # a file under the stranger's pid that it does not hold (a stale or planted name): never signalled
        (stacks / f"engine-30000-{stranger.pid}.txt").write_text("")
        text, missing = collect(tmp_path, timeout=20)
        assert missing == []
        assert f"=== rank0 (pid {rank.pid}): Python stacks of every thread ===" in text
        assert "waiting_for_a_collective" in text, text
        assert "engine-30000" not in text
        assert stranger.poll() is None and rank.poll() is None, "SIGUSR1 ended a process"
        # asked again, only the new dump is shown
        again, _ = collect(tmp_path, timeout=20)
        assert again.count("waiting_for_a_collective") == text.count("waiting_for_a_collective")
    finally:
        for process in (rank, stranger):
            process.kill()
            process.wait()
            assert process.stdout is not None
            process.stdout.close()


def test_nothing_live_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / "rank0-999999999.txt").write_text("")
    assert main([str(tmp_path)]) == 1
    assert "no live process of a run" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 1
