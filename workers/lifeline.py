"""The lifeline: every process the coordinator launches ends by itself when the coordinator is gone, however
it went (SIGKILL, OOM killer, a crash of the interpreter).

Run by `coordinator.lifecycle.processes.spawn_group_leader`, never by hand:

    python -I workers/lifeline.py FD GRACE_S -- COMMAND...

Owns the watcher: forked before COMMAND is exec'ed in this process's place, it blocks reading FD (a pipe whose
write end only the coordinator holds, never written), and on end-of-file stops COMMAND's process group and
descendants (SIGTERM, SIGKILL after GRACE_S, itself last). Why a pipe, not PR_SET_PDEATHSIG:
docs/fault-tolerance.md.

Invariants: the watcher imports only the standard library (`-I`); it ignores SIGTERM/SIGINT/SIGHUP, so the
coordinator's own stop of the group ends it with the rest; a failed exec is one line in the log and exit 127.
"""

from __future__ import annotations

import os
import signal
import sys
import time

#: The exit status of a command that could not be started (as a shell reports it).
CANNOT_RUN = 127


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: lifeline.py FD GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    fd, grace, command = int(argv[0]), float(argv[1]), argv[3:]
    leader = os.getpid()
    watcher = os.fork()
    if watcher == 0:
        _watch(fd, leader, grace)
    os.close(fd)  # the command needs no copy; the watcher holds the read end
    try:
        os.execvp(command[0], command)
    except OSError as error:
        os.kill(watcher, signal.SIGKILL)
        os.waitpid(watcher, 0)
        print(f"rayless: cannot run {command[0]!r}: {error.strerror or error}", file=sys.stderr, flush=True)
    return CANNOT_RUN


def _watch(fd: int, leader: int, grace: float) -> None:
    """The watcher's whole life: wait for the pipe to close, stop the group and the leader's descendants."""
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        while os.read(fd, 4096):  # nothing is written; b"" (end of file) means the coordinator has ended
            pass
        stop_orphans(leader, grace)
    finally:
        os._exit(0)  # never run the parent's exit handlers in the forked copy


def stop_orphans(leader: int, grace: float) -> None:
    """SIGTERM the leader's group and descendants; after `grace` s, SIGKILL what is left, this process last."""
    group, me = os.getpgrp(), os.getpid()
    print(f"rayless: the coordinator is gone; stopping process group {group} (pid {leader} and its descendants)",
          file=sys.stderr, flush=True)
    targets = _descendants(leader, me)
    _signal(group, targets, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (_alive(targets) or _group_members(group, me)):
        time.sleep(0.1)
    targets |= _descendants(leader, me)  # helpers started meanwhile
    _signal(group, targets, signal.SIGKILL)  # the group includes this process: the last thing it does


def _signal(group: int, targets: set[tuple[int, str]], sig: int) -> None:
    for pid, started in targets:
        if _start_time(pid) == started:  # still the process seen before, not a reused pid
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    try:
        os.killpg(group, sig)
    except OSError:
        pass


def _alive(targets: set[tuple[int, str]]) -> bool:
    return any(_start_time(pid) == started for pid, started in targets)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, pgrp, ...); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()
    return None if not fields or fields[0] in ("Z", "X") else fields


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _processes() -> list[tuple[int, int, int]]:
    """(pid, ppid, pgrp) of every live process (none without /proc)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        if name.isdigit() and (fields := _stat(int(name))) is not None:
            found.append((int(name), int(fields[1]), int(fields[2])))
    return found


def _descendants(root: int, me: int) -> set[tuple[int, str]]:
    """(pid, start time) of `root` and every live descendant, except `me`."""
    children: dict[int, list[int]] = {}
    for pid, ppid, _ in _processes():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid != me and (started := _start_time(pid)) is not None:
            found.add((pid, started))
        todo += children.get(pid, [])
    return found


def _group_members(group: int, me: int) -> bool:
    return any(pgrp == group and pid != me for pid, _, pgrp in _processes())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
