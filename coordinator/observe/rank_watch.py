"""A command the training ranks take too long to answer is named while it lasts, with their stacks.

Owns `RankCallWatch`: a task that looks, every `check_s`, at the command in flight on the control channel
(`ControlServer.in_flight`). Once it has waited longer than its bound — `--rank-call-warn-s`, or 3× the longest
earlier command of the same kind when that is more (a train step's time grows with its tokens; a save or a
weight export is slow once and then alike) — it logs one warning naming the command, the elapsed time and the
ranks that have not answered (pid, and the process state: a rank stopped by SIGSTOP or a debugger shows
`stopped`), collects every live process's stacks (`rayless stacks`, kept in `<run_dir>/stacks/`) and says
where they are; then again at 2×, 4×, … the bound while the same command waits. It never cancels anything:
ending a hung collective stays the process group's timeout's business, and train FT's.

Invariants: reads only the channel's public fields (the observe layer sits below `train`); the stacks are
collected in a worker thread, at most once per warning; one command is warned about at most
log2(wait / bound) + 1 times.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

log = logging.getLogger("rayless")

#: how many times longer than the longest earlier command of its kind a command may take before it is named
SLOWER_THAN_BEFORE = 3.0


class InFlightCommand(Protocol):
    kind: str
    started: float

    def waiting(self) -> list[int]: ...


class RankCallWatch:
    """`await task_group.start(watch.run)`; `warnings` lists what it logged (the status page, tests)."""

    def __init__(self, *, in_flight: Callable[[], InFlightCommand | None], longest_s: Callable[[str], float],
                 rank_pid: Callable[[int], int | None], floor_s: float, stacks_dir: Path | None,
                 check_s: float | None = None) -> None:
        if floor_s <= 0:
            raise ValueError(f"--rank-call-warn-s must be > 0, got {floor_s}")
        self.in_flight, self.longest_s, self.rank_pid = in_flight, longest_s, rank_pid
        self.floor_s = floor_s
        self.stacks_dir = stacks_dir
        self.check_s = check_s if check_s is not None else min(1.0, floor_s / 4)
        self.warnings: list[str] = []

    def bound_s(self, kind: str) -> float:
        return max(self.floor_s, SLOWER_THAN_BEFORE * self.longest_s(kind))

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        watched: InFlightCommand | None = None
        next_warning_s = 0.0
        while True:
            await anyio.sleep(self.check_s)
            command = self.in_flight()
            if command is None:
                watched = None
                continue
            if command is not watched:
                watched, next_warning_s = command, self.bound_s(command.kind)
            waited = time.monotonic() - command.started
            waiting = command.waiting()
            if waited < next_warning_s or not waiting:
                continue
            await self._warn(command.kind, waited, next_warning_s, waiting)
            next_warning_s *= 2

    async def _warn(self, kind: str, waited: float, bound: float, waiting: list[int]) -> None:
        ranks = ", ".join(self._describe(rank) for rank in waiting)
        where = ""
        if self.stacks_dir is not None:
            from coordinator.observe.stacks import collect_to_file

            kept = await anyio.to_thread.run_sync(collect_to_file, self.stacks_dir.parent, abandon_on_cancel=True)
            where = f"; every process's stacks: {kept}" if kept is not None else "; no stacks could be collected"
        message = (f"the training ranks' '{kind}' command has waited {waited:.0f}s (bound {bound:.0f}s: "
                   f"--rank-call-warn-s, or {SLOWER_THAN_BEFORE:g}x the longest earlier '{kind}') for "
                   f"{ranks}{where}")
        self.warnings.append(message)
        log.warning("%s", message)

    def _describe(self, rank: int) -> str:
        pid = self.rank_pid(rank)
        if pid is None:
            return f"rank {rank}"
        try:
            import psutil

            state = psutil.Process(pid).status()
        except Exception:  # gone, or not ours to read: the pid still names it
            return f"rank {rank} (pid {pid})"
        return f"rank {rank} (pid {pid}, {state})"
