"""run.sh as a person calls it, on an environment it finds up to date: `./run.sh ARGS` from a subdirectory with
a relative path, and the install stamp telling `./run.sh` (what running needs) from `./run.sh test` (the test
tools too).

The environment is this test's own directory whose `bin/python` and `bin/rayless` are the interpreter and the
`rayless` script running the tests, with a stamp written as run.sh writes it; PYTHON names no interpreter, so a
wrong "not up to date" would stop at run.sh's Python check (exit 1), never run pip. What an install prints is
tests/unit/test_pip_progress.py's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _has_gpu() -> bool:
    return subprocess.run(["bash", "-c", "command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1"],
                          check=False).returncode == 0


def _environment(tmp_path: Path, extras: str) -> Path:
    rayless = Path(sys.executable).parent / "rayless"
    if not rayless.exists():
        pytest.skip(f"no `rayless` script beside {sys.executable} (rayless is not installed in this environment)")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / "rayless").symlink_to(rayless)
    base = (ROOT / "pyproject.toml").read_text().rstrip("\n") + "\n" + ("gpu" if _has_gpu() else "cpu")
    (venv / ".rayless-install-stamp").write_text(f"{base}\nextras={extras}")
    return venv


def _run_sh(venv: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAYLESS_VENV": str(venv), "PYTHON": "/nonexistent/python3"}
    return subprocess.run(["bash", str(ROOT / "run.sh"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize("extras", ["run", "dev"])
def test_run_sh_args_run_in_the_callers_directory(tmp_path: Path, extras: str) -> None:
    """docs/rewards.md's example, typed in docs/ as the page says: the relative path is the caller's."""
    venv = _environment(tmp_path, extras)
    done = _run_sh(venv, ROOT / "docs", "reward", "score", "--rm-type", "math", "rewards_example.jsonl")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 8 and "8 rows scored with math" in done.stderr
    assert "installing" not in done.stderr, "an up-to-date environment is not installed again"


def test_test_tools_missing_means_an_install(tmp_path: Path) -> None:
    """A stamp of `./run.sh` (no test tools) does not satisfy `./run.sh test`: it goes on to install, which here
    stops at the Python check (PYTHON names none), before pip."""
    venv = _environment(tmp_path, "run")
    done = _run_sh(venv, tmp_path, "test", "--collect-only")
    assert done.returncode == 1 and "rayless needs Python >= 3.10" in done.stderr
    stale = _environment(tmp_path / "stale", "dev")
    stamp = stale / ".rayless-install-stamp"
    stamp.write_text(stamp.read_text().replace("rayless", "rayless-changed", 1))  # pyproject.toml changed since
    assert "rayless needs Python" in _run_sh(stale, tmp_path, "--help").stderr


def test_run_sh_is_valid_bash() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    assert subprocess.run([bash, "-n", str(ROOT / "run.sh")], check=False).returncode == 0
