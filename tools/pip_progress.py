"""pip's install output as run.sh shows it: one line per package, its size when pip downloads it, the elapsed time.

    pip install ... 2>&1 | python tools/pip_progress.py [--started EPOCH_SECONDS]

Owns the filter run.sh pipes pip through (it runs with the interpreter that creates the venv, before anything
is installed: standard library only). pip's own lines are long and many (a dependency already there is one
"Requirement already satisfied" line each); what a person wants from a first install that takes minutes is
what is being fetched, how big it is and how long it has been. Kept: "Collecting X" (with the size of its
"Downloading ... (SIZE)" line when one follows), "Processing FILE" (a wheel from a local index), "Installing collected packages", "Successfully installed",
errors and warnings other than pip's location notice; the satisfied requirements become one count.
Invariant: every line pip writes that starts with ERROR is passed on whole, and the exit status is pip's
business (the caller reads it from its pipeline), never this filter's.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator

_COLLECTING = re.compile(r"^Collecting (\S+)")
_PROCESSING = re.compile(r"^Processing (\S+)")  # a wheel from a local index or --find-links directory
_DOWNLOADING = re.compile(r"^\s+Downloading (\S+) \(([^)]+)\)")
_SATISFIED = re.compile(r"^Requirement already satisfied: ")
_INSTALLING = re.compile(r"^Installing collected packages: (.*)$")
_DONE = re.compile(r"^Successfully installed (.*)$")


def file_size(path: str) -> str | None:
    """A local wheel's size as pip writes a download's ("190.5 MB"), or None when it cannot be read."""
    try:
        size = float(os.path.getsize(path))
    except OSError:
        return None
    for unit in ("bytes", "kB", "MB"):
        if size < 1000 or unit == "MB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return None


def clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}"


def progress(lines: Iterable[str], elapsed: Iterator[float]) -> Iterator[str]:
    """The lines to show for pip's `lines`; `elapsed` yields the seconds since the install began, one value per
    line shown. A package is shown once: when its download starts, with its size, or else (a cached or local
    one) when pip moves on to the next top-level line."""
    pending: str | None = None  # a package collected and not shown yet
    satisfied = 0

    def shown(text: str) -> str:
        return f"[{clock(next(elapsed))}] {text}"

    for raw in lines:
        line = raw.rstrip("\n")
        if line[:1].isspace():  # pip's detail lines about the package being collected
            downloading = _DOWNLOADING.match(line)
            if downloading and pending is not None and not downloading.group(1).endswith(".metadata"):
                yield shown(f"downloading {pending} ({downloading.group(2)})")
                pending = None
            continue
        if pending is not None:
            yield shown(f"collecting {pending}")
            pending = None
        if collecting := _COLLECTING.match(line):
            pending = collecting.group(1)
        elif processing := _PROCESSING.match(line):
            path = processing.group(1)
            yield shown(f"collecting {path.rsplit('/', 1)[-1]} ({file_size(path) or 'local'})")
        elif _SATISFIED.match(line):
            satisfied += 1
        elif installing := _INSTALLING.match(line):
            names = installing.group(1).split(", ")
            if satisfied:
                yield shown(f"{satisfied} requirement(s) already installed")
                satisfied = 0
            yield shown(f"installing {len(names)} package(s) (the largest take a minute or two)")
        elif done := _DONE.match(line):
            yield shown(f"installed {len(done.group(1).split())} package(s)")
        elif line.startswith("ERROR") or (line.startswith("WARNING") and "WARNING: Location" not in line):
            yield line
    if pending is not None:
        yield shown(f"collecting {pending}")
    if satisfied:
        yield shown(f"{satisfied} requirement(s) already installed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--started", type=float, default=None, help="when the install began (seconds since the "
                        "epoch; default: now)")
    started = parser.parse_args(argv).started or time.time()

    def seconds() -> Iterator[float]:
        while True:
            yield time.time() - started

    for text in progress(sys.stdin, seconds()):
        print(f"\033[1m[run.sh]\033[0m {text}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
