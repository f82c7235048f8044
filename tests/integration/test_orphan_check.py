"""The orphan check (tests.support.orphans) in a pytest session of its own: it fails a session that leaves a
child process behind, naming its command line, and passes one whose children are all ended, including a child
owned by a session-scoped fixture (so the check runs after every other fixture's teardown)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

LEAKS = """
import pathlib, subprocess, sys

def test_leaves_a_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "left-behind"])
    pathlib.Path({pid_file!r}).write_text(str(child.pid))
"""

CLEAN = """
import subprocess, sys
import pytest

@pytest.fixture(scope="session")
def owned_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child
    child.terminate()
    child.wait(10)

def test_uses_a_child(owned_child):
    assert owned_child.poll() is None

def test_runs_and_ends_a_child():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def run_session(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makepyfile(test_session=source)
    # A short grace: a leak here is certain, and a clean child is reaped before the check looks.
    pytester.makeconftest("import tests.support.orphans as orphans\norphans.GRACE_S = 0.5\n")
    # PYTHONPATH (set by tests/conftest.py, kept by pytester) makes the plugin importable in the child pytest.
    return pytester.runpytest_subprocess("-p", "tests.support.orphans", "-p", "no:cacheprovider", timeout=120)


def test_a_session_that_leaves_a_child_fails_naming_it(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pid_file = tmp_path / "leaked.pid"
    try:
        result = run_session(pytester, LEAKS.format(pid_file=str(pid_file)))
    finally:
        if pid_file.exists():  # the leak outlives the child pytest: end it here
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_leaves_a_child*",
        "*child processes left by the test suite*",
        f"*pid {pid_file.read_text()}: *time.sleep(120) left-behind*",
    ])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_a_session_whose_children_are_ended_passes(pytester: pytest.Pytester) -> None:
    result = run_session(pytester, CLEAN)
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.OK
