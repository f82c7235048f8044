"""The rank-command deadline (`coordinator.observe.rank_watch.RankCallWatch`) against a real stopped process.

The "rank" is a real child process (`sleep`) stopped with SIGSTOP, as a rank stopped mid-step is; the command in
flight is a small record of what the control channel exposes (`kind`, `started`, `waiting()`). With train FT the
watch SIGKILLs the process at the deadline (torchrun's restart is train FT's, tested in test_train_ft); without
it the watch raises `RankOverdue` naming the command, the rank and the time waited. A command that was warned
about does not lengthen the bound of the next one of its kind.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field

import anyio
import pytest

from coordinator.observe.rank_watch import RankCallWatch, RankOverdue
from tests.support.waiting import wait_until

WARN, DEADLINE = 0.2, 0.6


@dataclass
class Command:
    kind: str
    started: float = field(default_factory=time.monotonic)
    ranks: list[int] = field(default_factory=lambda: [0])

    def waiting(self) -> list[int]:
        return self.ranks


def stopped_process() -> subprocess.Popen[bytes]:
    process = subprocess.Popen(["sleep", "60"])
    process.send_signal(signal.SIGSTOP)
    return process


def watch(command: Command | None, pid: int, *, kill: bool, longest: float = 0.0) -> RankCallWatch:
    return RankCallWatch(in_flight=lambda: command, longest_s=lambda kind: longest, rank_pid=lambda rank: pid,
                         floor_s=WARN, stacks_dir=None, check_s=0.05, deadline_floor_s=DEADLINE, kill_overdue=kill)


async def test_without_train_ft_the_deadline_ends_the_wait_naming_the_rank() -> None:
    process = stopped_process()
    try:
        started = time.monotonic()
        with anyio.fail_after(10), pytest.raises(RankOverdue) as overdue:
            await watch(Command("train"), process.pid, kill=False).run()
        elapsed = time.monotonic() - started
    finally:
        process.kill()
        process.wait()
    message = str(overdue.value)
    assert "'train' command passed its deadline" in message and f"rank 0 (pid {process.pid}, stopped)" in message
    assert "(deadline 1s: --rank-call-timeout-s" in message  # 0.6 s, printed whole
    assert DEADLINE <= elapsed < DEADLINE + 2, elapsed


async def test_with_train_ft_the_stopped_rank_is_killed_once_at_the_deadline() -> None:
    process = stopped_process()
    rank_watch = watch(Command("train"), process.pid, kill=True)
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(rank_watch.run)
                await wait_until(process.poll, timeout=8, what="the stopped rank killed at its deadline")
                await anyio.sleep(0.3)  # a few more ticks: it is killed once
                group.cancel_scope.cancel()
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL and rank_watch.killed == [process.pid]
    assert [w for w in rank_watch.warnings if "passed its deadline" in w] == rank_watch.warnings[-1:]


async def test_a_command_warned_about_does_not_lengthen_the_next_ones_bound() -> None:
    longest = {"train": 1.0}
    current: list[Command | None] = [Command("train", started=time.monotonic() - 0.5)]
    rank_watch = RankCallWatch(in_flight=lambda: current[0], longest_s=lambda kind: longest[kind],
                               rank_pid=lambda rank: None, floor_s=0.1, stacks_dir=None, check_s=0.02,
                               deadline_floor_s=100.0)
    async with anyio.create_task_group() as group:
        group.start_soon(rank_watch.run)
        with anyio.fail_after(10):
            while not rank_watch.warnings:  # past 3x the longest earlier (3 s), the hung command is named
                current[0].started -= 1.0  # type: ignore[union-attr]
                await anyio.sleep(0.05)
        longest["train"] = 50.0  # the channel's record of it once it ends
        current[0] = None
        await anyio.sleep(0.1)
        group.cancel_scope.cancel()
    assert rank_watch.bound_s("train") == 3.0 and rank_watch.deadline_s("train") == 100.0
