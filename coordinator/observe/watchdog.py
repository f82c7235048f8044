"""The coordinator's event-loop watchdog: the loop's lag as a figure, and a stall named while it lasts.

Owns `LoopWatchdog`: a task on the loop that wakes every `tick` seconds and records how late it woke (the lag),
and a thread outside the loop that, when the task has not run for more than `warn_s` seconds, logs once the
stack of the frame blocking the loop and the loop's task tree, naming the user code on that stack (a hook, a
reward or agent function loaded from outside rayless) when there is any, then again at `warn_s` × 2, × 4, ...
while the same stall lasts. A stalled loop cannot run its own health probes, timers or signal handling, so
only a thread can see it (prime-rl #1713: a 700 s silent stall of a single-loop coordinator).

Invariants: the thread only reads (`sys._current_frames`, the loop's task set while the loop is blocked, so
not changing) and logs; it never touches the loop or its tasks. Its cost is one sleep-and-compare per
`check_s`, and the loop task's is one `anyio.sleep(tick)` per tick (bench/watchdog.py). The thread ends with
the task (a cancelled run stops it); it is a daemon, so a coordinator ending without that still exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import anyio
from anyio.abc import TaskStatus

log = logging.getLogger("rayless.watchdog")

#: where rayless' own code and the interpreter's libraries live: a frame elsewhere is user code
_OWN_ROOTS = tuple(str(Path(__file__).resolve().parents[2] / name) for name in ("coordinator", "workers", "replay"))
_LIBRARY_ROOTS = tuple({str(Path(p).resolve()) for p in (sysconfig.get_paths()["stdlib"],
                                                          sysconfig.get_paths()["purelib"],
                                                          sysconfig.get_paths()["platlib"])})
#: the file `rayless stacks` creates in the stacks directory to ask for the loop's task tree
TASKS_REQUEST = "coordinator-tasks.request"
#: frames shown per task of the loop's task tree (innermost first)
AWAIT_FRAMES = 4
#: stack frames kept in a stall report (innermost last)
STACK_LIMIT = 40


def is_user_code(filename: str) -> bool:
    """A frame from a file outside rayless' packages and outside the interpreter's libraries."""
    if filename.startswith("<"):
        return False
    resolved = str(Path(filename).resolve())
    return not resolved.startswith(_OWN_ROOTS) and not resolved.startswith(_LIBRARY_ROOTS)


@dataclass
class LagStats:
    """The loop's lag: the latest, the largest since the last `take_window_max()`, and the stalls seen."""

    last_s: float = 0.0
    window_max_s: float = 0.0
    max_s: float = 0.0
    stalls: int = 0

    def record(self, lag: float) -> None:
        self.last_s = lag
        self.window_max_s = max(self.window_max_s, lag)
        self.max_s = max(self.max_s, lag)

    def take_window_max(self) -> float:
        """The largest lag since the previous call (a step's row in metrics.jsonl), then start a new window."""
        value, self.window_max_s = self.window_max_s, self.last_s
        return value


class LoopWatchdog:
    """`await task_group.start(watchdog.run)` on the loop to watch; `stats` is the lag (seconds)."""

    def __init__(self, warn_s: float, *, tick: float | None = None, stacks_dir: Path | None = None) -> None:
        if warn_s <= 0:
            raise ValueError(f"--loop-stall-warn-s must be > 0, got {warn_s}")
        self.warn_s = warn_s
        # A tick well under the threshold, so a stall is timed to within a quarter of it; at most 0.5 s, so the
        # lag figure means something on a healthy loop.
        self.tick = tick if tick is not None else min(0.5, warn_s / 4)
        self.check_s = min(0.5, warn_s / 4)
        self.stats = LagStats()
        self.reports: list[str] = []  # each stall report logged, newest last (the status page, tests)
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._loop_thread: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: `rayless stacks` asks for the task tree by creating TASKS_REQUEST here; the thread answers in
        #: `coordinator-<pid>.tasks.txt` (polled, so it is answered even while the loop is blocked)
        self.stacks_dir = stacks_dir

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._loop_thread = threading.get_ident()
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # trio: the task tree is not read, the stack still is
            self._loop = None
        self._beat = time.monotonic()
        thread = threading.Thread(target=self._watch, name="rayless-loop-watchdog", daemon=True)
        thread.start()
        task_status.started()
        try:
            while True:
                before = time.monotonic()
                await anyio.sleep(self.tick)
                now = time.monotonic()
                self.stats.record(max(0.0, now - before - self.tick))
                self._beat = now
        finally:
            self._stop.set()

    # -- the thread ------------------------------------------------------------------------------------------

    def _watch(self) -> None:
        reported_beat: float | None = None  # the beat of the stall last reported
        next_report_s = self.warn_s
        while not self._stop.wait(self.check_s):
            self._answer_task_request()
            beat = self._beat
            if beat != reported_beat:  # the loop ran since the last report (or none yet): thresholds anew
                next_report_s = self.warn_s
            stalled_s = time.monotonic() - beat
            if stalled_s < next_report_s:
                continue
            first = beat != reported_beat
            if first:
                self.stats.stalls += 1
                reported_beat = beat
            self._report(stalled_s, first=first)
            next_report_s *= 2

    def _report(self, stalled_s: float, *, first: bool) -> None:
        frame = sys._current_frames().get(self._loop_thread or -1)
        stack = traceback.extract_stack(frame, limit=STACK_LIMIT) if frame is not None else traceback.StackSummary()
        user = next((f for f in reversed(stack) if is_user_code(f.filename)), None)
        where = (f"user code {user.name} at {user.filename}:{user.lineno}" if user is not None
                 else (f"{stack[-1].name} at {stack[-1].filename}:{stack[-1].lineno}" if stack else "an unknown frame"))
        lines = [f"the coordinator's event loop has not run for {stalled_s:.1f}s (--loop-stall-warn-s "
                 f"{self.warn_s:g}): blocked in {where}; every task waits meanwhile (health probes, timers, "
                 "signals). A hook doing blocking work should await its I/O or offload it "
                 "(`await anyio.to_thread.run_sync(...)`)."]
        if first:
            lines.append("blocking stack (innermost last):\n" + "".join(stack.format()).rstrip())
            tasks = self._task_tree()
            if tasks:
                lines.append("the loop's tasks:\n" + tasks)
        report = "\n".join(lines)
        self.reports.append(report)
        log.warning("%s", report)

    def _answer_task_request(self) -> None:
        if self.stacks_dir is None:
            return
        request = self.stacks_dir / TASKS_REQUEST
        if not request.exists():
            return
        stalled_s = time.monotonic() - self._beat
        text = (f"--- the coordinator's event loop at {time.strftime('%H:%M:%S')}: last ran "
                f"{stalled_s:.1f}s ago; largest lag of the run {self.stats.max_s:.2f}s ---\n"
                f"{self._task_tree() or '  (no task tree: the loop is not asyncio, or it moved while read)'}\n")
        try:
            with (self.stacks_dir / f"coordinator-{os.getpid()}.tasks.txt").open("a", encoding="utf-8") as file:
                file.write(text)
            request.unlink(missing_ok=True)
        except OSError as error:
            log.warning("could not write the loop's task tree for `rayless stacks`: %s", error)

    def _task_tree(self) -> str:
        """Each asyncio task of the loop with the frame it waits in (read while the loop is blocked)."""
        if self._loop is None:
            return ""
        tasks: list[asyncio.Task[object]] = []
        for _ in range(5):  # read from this thread: a running loop may change its task set meanwhile
            try:
                tasks = list(asyncio.all_tasks(self._loop))
                break
            except RuntimeError:
                continue
        rows = []
        for task in sorted(tasks, key=lambda t: t.get_name()):
            rows.append(f"  {task.get_name()}: {_awaiting(task)}")
        return "\n".join(rows)


def _awaiting(task: asyncio.Task[object]) -> str:
    """Where a task's coroutine chain is suspended: its innermost `AWAIT_FRAMES` frames, innermost first."""
    coro = task.get_coro()
    frames: list[FrameType] = []
    for _ in range(64):  # bounded walk down cr_await
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        awaited = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if awaited is None:
            break
        coro = awaited
    if not frames:
        return "running" if not task.done() else "done"
    return " <- ".join(f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})"
                       for f in reversed(frames[-AWAIT_FRAMES:]))
