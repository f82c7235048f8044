"""run.sh's install progress (tools/pip_progress.py) on pip's own output: one line per package, the size of a
download, the elapsed time, the satisfied requirements as one count, errors passed on whole."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

from tools.pip_progress import progress

# pip 24/25's output for a first install (progress bar off), as run.sh asks for it
PIP_OUTPUT = """\
Looking in indexes: https://pypi.org/simple, file:///opt/pypi/simple
Obtaining file:///work/rayless
  Installing build dependencies: started
  Installing build dependencies: finished with status 'done'
Collecting torch==2.13.0
  Downloading torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl.metadata (29 kB)
  Downloading torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl (190.5 MB)
Requirement already satisfied: filelock in ./.venv/lib/python3.11/site-packages (from torch==2.13.0) (3.16.1)
Requirement already satisfied: jinja2 in ./.venv/lib/python3.11/site-packages (from torch==2.13.0) (3.1.4)
Collecting sympy>=1.13.3 (from torch==2.13.0)
  Using cached sympy-1.13.3-py3-none-any.whl.metadata (12 kB)
WARNING: Location 'file:///opt/pypi-more/simple/six/' is ignored: it is neither a file nor a directory.
Processing /no/such/mirror/six-1.17.0-py2.py3-none-any.whl
Collecting anyio<5,>=4.4 (from rayless==0.1.0)
  Downloading anyio-4.6.2-py3-none-any.whl (90 kB)
Building wheels for collected packages: rayless
Installing collected packages: sympy, anyio, torch, rayless
WARNING: Location 'https://download.pytorch.org/whl/cpu' is ignored: it is either a non-existing path or lacks a
Successfully installed anyio-4.6.2 rayless-0.1.0 sympy-1.13.3 torch-2.13.0
"""


def test_one_line_per_package_with_its_size_and_the_time() -> None:
    shown = list(progress(PIP_OUTPUT.splitlines(keepends=True), itertools.count(5, 30)))
    assert shown == [
        "[0:05] downloading torch==2.13.0 (190.5 MB)",
        "[0:35] collecting sympy>=1.13.3",
        "[1:05] collecting six-1.17.0-py2.py3-none-any.whl (local)",
        "[1:35] downloading anyio<5,>=4.4 (90 kB)",
        "[2:05] 2 requirement(s) already installed",
        "[2:35] installing 4 package(s) (the largest take a minute or two)",
        "[3:05] installed 4 package(s)",
    ]


def test_a_local_wheel_is_shown_with_its_size(tmp_path: Path) -> None:
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"0" * 2_500_000)
    assert list(progress([f"Processing {wheel}\n"], itertools.count())) == [
        f"[0:00] collecting {wheel.name} (2.5 MB)"]


def test_errors_pass_through_whole_and_an_unfinished_collect_is_shown() -> None:
    lines = ["Collecting nosuchpackage==9\n",
             "ERROR: Could not find a version that satisfies the requirement nosuchpackage==9\n"]
    assert list(progress(lines, itertools.count())) == [
        "[0:00] collecting nosuchpackage==9",
        "ERROR: Could not find a version that satisfies the requirement nosuchpackage==9",
    ]


def test_run_sh_pipes_pip_through_it() -> None:
    """The filter as run.sh runs it (a script, standard library only) reads all of stdin, writes to stderr."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "tools" / "pip_progress.py"), "--started", "0"],
                          input=PIP_OUTPUT, capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 7 and lines[0].endswith("downloading torch==2.13.0 (190.5 MB)")
    assert "[run.sh]" in lines[0]
