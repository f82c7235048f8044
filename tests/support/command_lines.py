"""What `ps` shows of a run: the command lines of every process the test process has started, read while they
live (a training-loop hook calls `CommandLines.after_step`, when the engines, torchrun and its ranks are up).

Owns `CommandLines`: every descendant's command line seen at each step, by pid. Invariant: it only reads
`/proc` (through psutil); a process gone between listing and reading is skipped.
"""

from __future__ import annotations

import os

import psutil


class CommandLines:
    """A `StepHook` recording the command lines (as `/proc/PID/cmdline` gives them) of this process's descendants."""

    def __init__(self) -> None:
        self.seen: dict[int, str] = {}

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        for child in psutil.Process(os.getpid()).children(recursive=True):
            try:
                self.seen[child.pid] = " ".join(child.cmdline())
            except psutil.Error:
                continue

    def holding(self, text: str) -> list[str]:
        return [line for line in self.seen.values() if text in line]
