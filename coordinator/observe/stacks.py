"""Where every process of a live run is: `rayless stacks RUN_DIR`, and the run's side of it.

Owns `enable(run_dir)` (the coordinator, at the start of a run: the stacks directory in the environment its
children inherit, its own dump registered) and `main` (the command). The command finds the processes that
registered (`workers/stack_dumps.py`: `<run_dir>/stacks/<role>-<pid>.txt`), asks the coordinator's watchdog
thread for the event loop's task tree (a request file it polls, so a blocked loop still answers), sends each
process SIGUSR1 (faulthandler writes all its threads' stacks from the signal handler), waits until each file
has stopped growing, then prints what each wrote and keeps the whole as `<run_dir>/stacks/dump-<time>.txt`.

Invariants: only a live process that holds its registered file open is signalled (SIGUSR1 ends a process
without the handler; a reused pid holds no such file); the command reads at most `READ_LIMIT` bytes of each
answer; it ends within `--timeout` seconds, naming the processes that did not answer. Processes on other nodes are not reached: run
the command on each node's shared run directory view (docs/observability.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.observe.watchdog import TASKS_REQUEST
from workers import stack_dumps

#: an answer read beyond this is cut (a process with thousands of threads)
READ_LIMIT = 4 * 2**20
#: how long an answer must stop growing before it counts as complete
SETTLE_S = 0.3


def enable(run_dir: Path) -> Path:
    """The coordinator's part: children started from now on register their dumps in `<run_dir>/stacks`."""
    directory = run_dir / "stacks"
    os.environ[stack_dumps.ENV_STACKS_DIR] = str(directory)
    stack_dumps.install("coordinator")
    return directory


def disable() -> None:
    os.environ.pop(stack_dumps.ENV_STACKS_DIR, None)
    stack_dumps.uninstall()


@dataclass
class Target:
    role: str
    pid: int
    path: Path
    size_before: int = 0

    @property
    def kind(self) -> str:
        return "rank" if self.role.startswith("rank") else "engine" if self.role.startswith("engine") \
            else "coordinator"


def live_targets(directory: Path) -> list[Target]:
    """The registered processes of the run that are alive and run our code, the coordinator first."""
    import psutil

    targets = []
    for path in sorted(directory.glob("*-*.txt")):
        if path.name.startswith("dump-") or path.name.endswith(".tasks.txt"):
            continue
        role, _, pid_text = path.stem.rpartition("-")
        if not pid_text.isdigit() or not role:
            continue
        target = Target(role, int(pid_text), path)
        try:
            held = {Path(f.path) for f in psutil.Process(target.pid).open_files()}
        except (psutil.Error, OSError):
            continue  # a process of an earlier run, or one that has ended
        # the process holds the file open: it is the one that registered the handler under this name (a pid
        # reused by another program holds no such file)
        if path.resolve() in {h.resolve() for h in held}:
            targets.append(target)
    return sorted(targets, key=lambda t: (t.kind != "coordinator", t.kind, t.role))


def _read_from(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as file:
            file.seek(offset)
            data = file.read(READ_LIMIT)
    except OSError as error:
        return f"(could not read {path}: {error})"
    return data.decode("utf-8", errors="replace")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def collect(run_dir: Path, *, timeout: float) -> tuple[str, list[Target]]:
    """Signal every live process of the run and gather their answers; returns (text, targets not answering)."""
    directory = run_dir / "stacks"
    targets = live_targets(directory)
    if not targets:
        return "", []
    coordinator = next((t for t in targets if t.kind == "coordinator"), None)
    tasks_file = directory / f"coordinator-{coordinator.pid}.tasks.txt" if coordinator else None
    tasks_before = _size(tasks_file) if tasks_file else 0
    if tasks_file is not None:
        (directory / TASKS_REQUEST).touch()
    for target in targets:
        target.size_before = _size(target.path)
        try:
            os.kill(target.pid, stack_dumps.DUMP_SIGNAL)
        except OSError:
            pass  # ended since: it will show as not answering
    deadline = time.monotonic() + timeout
    waiting = [t.path for t in targets] + ([tasks_file] if tasks_file else [])
    before = {t.path: t.size_before for t in targets} | ({tasks_file: tasks_before} if tasks_file else {})
    last_sizes: dict[Path, int] = {}
    stable_since: dict[Path, float] = {}
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        for path in list(waiting):
            size = _size(path)
            if size <= before[path]:
                continue
            if last_sizes.get(path) != size:
                last_sizes[path], stable_since[path] = size, time.monotonic()
            elif time.monotonic() - stable_since[path] >= SETTLE_S:
                waiting.remove(path)
    sections = []
    if tasks_file is not None and coordinator is not None:
        answered = tasks_file not in waiting
        sections.append(f"=== coordinator (pid {coordinator.pid}): event loop tasks ===\n"
                        + (_read_from(tasks_file, tasks_before) if answered else "(no answer)\n"))
    missing = [t for t in targets if t.path in waiting]
    for target in targets:
        body = _read_from(target.path, target.size_before) if target not in missing else "(no answer)\n"
        sections.append(f"=== {target.role} (pid {target.pid}): Python stacks of every thread ===\n{body}")
    (directory / TASKS_REQUEST).unlink(missing_ok=True)
    return "\n".join(sections), missing


def collect_to_file(run_dir: Path, *, timeout: float = 10.0) -> Path | None:
    """`collect`, kept as `<run_dir>/stacks/dump-<time>.txt` (None when nothing live answered or it could not
    be written). Called by the command and by the rank watch when a command waits past its bound."""
    text, missing = collect(run_dir, timeout=timeout)
    if not text:
        return None
    if missing:
        text += "\n" + "no answer within {:g}s from {}\n".format(
            timeout, ", ".join(f"{t.role} (pid {t.pid}, {_state(t.pid)})" for t in missing))
    kept = run_dir / "stacks" / f"dump-{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns() % 10**6:06d}.txt"
    try:
        kept.write_text(text, encoding="utf-8")
    except OSError:
        return None
    return kept


def _state(pid: int) -> str:
    """The process's state as `ps` says it: a rank stopped by SIGSTOP or a debugger cannot answer (`stopped`)."""
    import psutil

    try:
        return str(psutil.Process(pid).status())
    except (psutil.Error, OSError):
        return "gone"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rayless stacks",
        description="Print the live Python stacks of a running job: the coordinator's event-loop tasks and "
                    "threads, every training rank and every in-repo engine of this node (no py-spy needed). "
                    "Also kept as RUN_DIR/stacks/dump-<time>.txt.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (--run-dir)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for every process's answer (default 10)")
    args = parser.parse_args(list(argv))
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"rayless stacks: {run_dir} is not a directory", file=sys.stderr)
        return 1
    text, missing = collect(run_dir, timeout=args.timeout)
    if not text:
        print(f"rayless stacks: no live process of a run in {run_dir} (nothing registered in "
              f"{run_dir / 'stacks'}, or every process there has ended)", file=sys.stderr)
        return 1
    kept = run_dir / "stacks" / f"dump-{time.strftime('%Y%m%d-%H%M%S')}.txt"
    try:
        kept.write_text(text, encoding="utf-8")
    except OSError as error:
        print(f"rayless stacks: could not keep the dump in {kept}: {error}", file=sys.stderr)
    try:
        sys.stdout.write(text)
        sys.stdout.write(f"\n(kept in {kept})\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `rayless stacks RUN | head`: the reader has what it wanted
        sys.stdout = open(os.devnull, "w")  # nothing more is written: no flush error at exit
    if missing:
        print("rayless stacks: no answer within {:g}s from {}".format(
            args.timeout, ", ".join(f"{t.role} (pid {t.pid}, {_state(t.pid)})" for t in missing)), file=sys.stderr)
        return 1
    return 0
