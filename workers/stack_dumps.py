"""A process's Python stacks on demand: SIGUSR1 writes every thread's stack to the run's stacks directory.

Owns `install(role)`, called once by each process of a run (the coordinator, every training rank, every in-repo
engine). When the coordinator has set `RAYLESS_STACKS_DIR` (children inherit it), it opens
`<dir>/<role>-<pid>.txt` and registers faulthandler for SIGUSR1 on it: the dump is written by C code in the
signal handler, so it comes even from a process whose Python is stuck in a C call or a deadlocked collective,
and needs no py-spy. `rayless stacks RUN_DIR` (coordinator/lifecycle/stacks.py) sends the signals.

Invariants: a process is signalled only once its file exists under that name, given after the handler
is registered — SIGUSR1's default action ends a process, so nothing without the handler (a real SGLang server)
is ever sent one; the handler replaces that default action (it does not chain to it).
"""

from __future__ import annotations

import faulthandler
import os
import signal
from pathlib import Path
from typing import TextIO

ENV_STACKS_DIR = "RAYLESS_STACKS_DIR"
#: the signal `rayless stacks` sends; SIGUSR2 is left to users' own tools
DUMP_SIGNAL = signal.SIGUSR1

_open: list[TextIO] = []  # the dump files, kept open for the process's life (faulthandler writes to their fds)


def dump_path(directory: Path, role: str, pid: int) -> Path:
    return directory / f"{role}-{pid}.txt"


def install(role: str) -> Path | None:
    """Register the stack dump of this process under `role` (e.g. `rank0`, `engine-30000`); None where the
    run set no stacks directory (a process started by hand) or the platform has no SIGUSR1."""
    directory = os.environ.get(ENV_STACKS_DIR)
    if not directory or not hasattr(signal, "SIGUSR1"):
        return None
    path = dump_path(Path(directory), role, os.getpid())
    opening = path.with_name(path.name + ".opening")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = opening.open("a", encoding="utf-8")
    except OSError:
        return None  # a read-only run directory costs the stacks, never the process
    # chain=False: the previous handler is the default action, which would end the process after the dump
    faulthandler.register(DUMP_SIGNAL, file=file, all_threads=True, chain=False)
    _open.append(file)
    os.replace(opening, path)  # the name that says "signal me" only once the handler is in place
    return path


def uninstall() -> None:
    """Unregister and close (the coordinator at the end of a run; a process that exits needs nothing)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.unregister(DUMP_SIGNAL)
    while _open:
        _open.pop().close()
