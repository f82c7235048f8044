"""A command the training ranks take too long to answer is named while it lasts, with their stacks.

Owns `RankCallWatch`: a task that looks, every `check_s`, at the command in flight on the control channel
(`ControlServer.in_flight`). Once it has waited longer than its bound — `--rank-call-warn-s`, or 3× the longest
earlier command of the same kind when that is more (a train step's time grows with its tokens; a save or a
weight export is slow once and then alike) — it logs one warning naming the command, the elapsed time and the
ranks that have not answered (pid, and the process state: a rank stopped by SIGSTOP or a debugger shows
`stopped`), collects every live process's stacks (`rayless stacks`, kept in `<run_dir>/stacks/`) and says
where they are; then again at 2×, 4×, … the bound while the same command waits.

Past its *deadline* — `--rank-call-timeout-s`, or `DEADLINE_TIMES`× the longest earlier command of its kind
when that is more — the wait ends: the stacks are collected once more (before anything is killed), then with
train FT the ranks that have not answered are SIGKILLed (torchrun restarts the group and train FT reloads the
last checkpoint, as for any dead rank); without it the watch raises `RankOverdue`, which ends the run with one
line naming the command, the ranks, the deadline and the time waited.

Invariants: reads only the channel's public fields (the observe layer sits below `train`); the stacks are
collected in a worker thread, at most once per warning and once at the deadline; one command is warned about at
most log2(wait / bound) + 1 times and met at its deadline once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import anyio
from anyio.abc import TaskStatus

from workers.errors import RaylessError

log = logging.getLogger("rayless")

#: how many times longer than the longest earlier command of its kind a command may take before it is named
SLOWER_THAN_BEFORE = 3.0
#: how many times longer than the longest earlier command of its kind a command may take before its wait ends
DEADLINE_TIMES = 10.0


class RankOverdue(RaylessError):
    """A command to the training ranks passed its deadline (no train FT to restart the ranks): names the
    command, the ranks that did not answer, the deadline and the time waited."""


class InFlightCommand(Protocol):
    kind: str
    started: float

    def waiting(self) -> list[int]: ...


class RankCallWatch:
    """`await task_group.start(watch.run)`; `warnings` lists what it logged (the status page, tests)."""

    def __init__(self, *, in_flight: Callable[[], InFlightCommand | None], longest_s: Callable[[str], float],
                 rank_pid: Callable[[int], int | None], floor_s: float, stacks_dir: Path | None,
                 check_s: float | None = None, deadline_floor_s: float = 3600.0,
                 kill_overdue: bool = False) -> None:
        if floor_s <= 0:
            raise ValueError(f"--rank-call-warn-s must be > 0, got {floor_s}")
        if deadline_floor_s <= 0:
            raise ValueError(f"--rank-call-timeout-s must be > 0, got {deadline_floor_s}")
        self.deadline_floor_s = deadline_floor_s
        #: train FT: an overdue rank is SIGKILLed (restarted by torchrun), not the run ended
        self.kill_overdue = kill_overdue
        #: the ranks killed at a deadline (pids)
        self.killed: list[int] = []
        self.in_flight, self.longest_s, self.rank_pid = in_flight, longest_s, rank_pid
        self.floor_s = floor_s
        self.stacks_dir = stacks_dir
        self.check_s = check_s if check_s is not None else min(1.0, floor_s / 4)
        self.warnings: list[str] = []
        #: per kind: the longest earlier command before one that was warned about (`_longest`)
        self._caps: dict[str, float] = {}

    def _longest(self, kind: str) -> float:
        """The longest earlier command of `kind`, leaving out those that were warned about: a hang is not a
        measure of the work, and must not lengthen the next command's bound and deadline tenfold."""
        return min(self.longest_s(kind), self._caps.get(kind, float("inf")))

    def bound_s(self, kind: str) -> float:
        return max(self.floor_s, SLOWER_THAN_BEFORE * self._longest(kind))

    def deadline_s(self, kind: str) -> float:
        return max(self.deadline_floor_s, DEADLINE_TIMES * self._longest(kind))

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        watched: InFlightCommand | None = None
        next_warning_s = deadline = before = 0.0
        met = warned = False
        while True:
            await anyio.sleep(self.check_s)
            command = self.in_flight()
            if command is not watched and watched is not None:  # it ended (or another began)
                if warned:  # its time is not the work's
                    self._caps[watched.kind] = before
                elif watched.kind in self._caps:
                    self._caps[watched.kind] = max(self._caps[watched.kind], time.monotonic() - watched.started)
            if command is None:
                watched = None
                continue
            if command is not watched:
                watched, next_warning_s, deadline = command, self.bound_s(command.kind), self.deadline_s(command.kind)
                before, met, warned = self._longest(command.kind), False, False
            waited = time.monotonic() - command.started
            waiting = command.waiting()
            if not waiting:
                continue
            if waited >= deadline and not met:
                met = True
                await self._overdue(command.kind, waited, deadline, waiting)
            elif waited >= next_warning_s and not met:
                warned = True
                await self._warn(command.kind, waited, next_warning_s, waiting)
                next_warning_s *= 2

    async def _overdue(self, kind: str, waited: float, deadline: float, waiting: list[int]) -> None:
        """The deadline: the stacks first, then the ranks killed (train FT) or the run ended."""
        ranks = ", ".join(self._describe(rank) for rank in waiting)
        where = await self._collect()
        message = (f"the training ranks' '{kind}' command passed its deadline: {waited:.0f}s waited for {ranks} "
                   f"(deadline {deadline:.0f}s: --rank-call-timeout-s, or {DEADLINE_TIMES:g}x the longest earlier "
                   f"'{kind}'){where}")
        if not self.kill_overdue:
            raise RankOverdue(message)
        import os
        import signal

        for rank in waiting:
            pid = self.rank_pid(rank)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.killed.append(pid)
        self.warnings.append(message)
        log.error("%s; killed them: train FT restarts the ranks from the last checkpoint", message)

    async def _collect(self) -> str:
        if self.stacks_dir is None:
            return ""
        from coordinator.observe.stacks import collect_to_file

        kept = await anyio.to_thread.run_sync(collect_to_file, self.stacks_dir.parent, abandon_on_cancel=True)
        return f"; every process's stacks: {kept}" if kept is not None else "; no stacks could be collected"

    async def _warn(self, kind: str, waited: float, bound: float, waiting: list[int]) -> None:
        ranks = ", ".join(self._describe(rank) for rank in waiting)
        where = await self._collect()
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
