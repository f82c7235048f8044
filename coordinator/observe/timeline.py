"""The run's phase timeline: what each part of the run did when, as Chrome trace events (docs/observability.md).

Owns `Timeline` (the recorder), the run's current timeline (a context variable every task of the run inherits,
so a phase is instrumented with one `with span(...)` and no recorder passed around) and the file
`<run_dir>/timeline.json`, which opens in Perfetto or chrome://tracing.

Events are "X" (complete) events with `ts` / `dur` in microseconds since the run began; `pid` is a row group
("loop", "train ranks", "rollout engines", ...) and `tid` a row in it (a rank, an engine, a lane), each named
by an "M" metadata event. Every event's args carry the rollout id and the weight version current when it began.

Invariants: a span never raises into the code it measures (no timeline: a no-op); two spans open at once on one
row are nested (spans that may overlap — `lanes=True`, or no row named — get a lane of their own, the lowest free
one: "lane 0", ... or "<row>", "<row> #1", ...), so every row is a valid flame; memory is bounded (at most `max_events_per_group` events per row group, the oldest
dropped first); the file is replaced atomically, so a crash leaves the last complete write.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from pathlib import Path
from typing import Any

#: Row groups, in the order they are shown (Perfetto sorts by pid).
GROUPS = ("loop", "rollout", "train ranks", "weight sync", "colocation", "eval", "rollout engines",
          "eval engines", "health")
#: The row of the loop's phases (generate, train, sync, save) and the one of whole steps.
PHASES = ("loop", "phases")
STEPS = ("loop", "steps")

_CURRENT: ContextVar[Timeline | None] = ContextVar("rayless_timeline", default=None)


class Timeline:
    """Records complete events; `write()` puts them in `path` (Chrome's JSON object format)."""

    def __init__(self, path: Path | None, *, max_events_per_group: int = 20_000) -> None:
        self.path = path
        self.origin = time.monotonic()
        self.max_events_per_group = max_events_per_group
        self.rollout_id: int | None = None
        self.weight_version: str | None = None
        self._events: dict[int, deque[dict[str, Any]]] = {}
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[int, str], int] = {}
        self._busy_lanes: dict[tuple[str, str], set[int]] = {}
        self.dropped = 0
        self._open: list[str] = []  # the loop's phases open now, outermost first

    def at_step(self, rollout_id: int, weight_version: str) -> None:
        """The rollout id and weight version later events are tagged with."""
        self.rollout_id, self.weight_version = rollout_id, weight_version

    def _row(self, group: str, row: str) -> tuple[int, int]:
        pid = self._pids.get(group)
        if pid is None:
            pid = self._pids[group] = (GROUPS.index(group) + 1) if group in GROUPS else 100 + len(self._pids)
        tid = self._tids.get((pid, row))
        if tid is None:
            tid = self._tids[(pid, row)] = len([key for key in self._tids if key[0] == pid]) + 1
        return pid, tid

    def _args(self, args: dict[str, Any]) -> dict[str, Any]:
        tagged: dict[str, Any] = {"rollout_id": self.rollout_id, "weight_version": self.weight_version}
        tagged.update({key: value if isinstance(value, int | float | str | bool) or value is None else str(value)
                       for key, value in args.items()})
        return tagged

    def complete(self, name: str, started: float, seconds: float, track: tuple[str, str],
                 **args: Any) -> None:
        """One finished event: `started` is a time.monotonic() reading, `seconds` its length."""
        pid, tid = self._row(*track)
        events = self._events.setdefault(pid, deque(maxlen=self.max_events_per_group))
        if len(events) == events.maxlen:
            self.dropped += 1
        events.append({"name": name, "cat": track[0], "ph": "X", "pid": pid, "tid": tid,
                       "ts": round((started - self.origin) * 1e6, 1), "dur": round(max(seconds, 0.0) * 1e6, 1),
                       "args": self._args(args)})

    @contextmanager
    def span(self, name: str, track: tuple[str, str | None] = PHASES, *, lanes: bool = False,
             **args: Any) -> Iterator[None]:
        """Record the body as one event on `track` = (group, row); with `lanes` (or row None) on the lowest
        lane of that row free now."""
        group, base = track
        row = base or ""
        lane = None
        if lanes or base is None:
            busy = self._busy_lanes.setdefault((group, row), set())
            lane = next(i for i in range(len(busy) + 1) if i not in busy)
            busy.add(lane)
            row = f"lane {lane}" if base is None else (row if lane == 0 else f"{row} #{lane}")
        tagged = {"rollout_id": self.rollout_id, "weight_version": self.weight_version, **args}
        started = time.monotonic()
        failed: str | None = None
        if track == PHASES:
            self._open.append(name)
        try:
            yield
        except BaseException as error:
            failed = type(error).__name__
            raise
        finally:
            if track == PHASES:
                self._open.remove(name)
            if lane is not None:
                self._busy_lanes[(group, base or "")].discard(lane)
            if failed is not None:
                tagged["error"] = failed
            self.complete(name, started, time.monotonic() - started, (group, row), **tagged)

    def events(self) -> list[dict[str, Any]]:
        """Every event kept, metadata first, then by start time."""
        names = {pid: group for group, pid in self._pids.items()}
        meta: list[dict[str, Any]] = []
        for pid, group in sorted(names.items()):
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": group}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                         "args": {"sort_index": pid}})
        for (pid, row), tid in sorted(self._tids.items(), key=lambda item: item[1]):
            if row:
                meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": row}})
        timed = sorted((e for events in list(self._events.values()) for e in list(events)),
                       key=lambda e: e["ts"])
        return meta + timed

    def recent(self, seconds: float) -> list[dict[str, Any]]:
        """The events that ended within the last `seconds` (the status page's timeline), by start time, each
        with its row's names. Work in proportion to those events only: each group's events are kept in the
        order they ended, so the walk back stops at the first older one."""
        since = (time.monotonic() - self.origin - seconds) * 1e6
        groups = {pid: group for group, pid in self._pids.items()}
        rows = {(pid, tid): row for (pid, row), tid in self._tids.items()}
        found: list[dict[str, Any]] = []
        for pid, events in list(self._events.items()):
            for event in reversed(events):
                if event["ts"] + event["dur"] < since:
                    break
                found.append({**event, "group": groups.get(pid, ""), "row": rows.get((pid, event["tid"]), "")})
        return sorted(found, key=lambda e: e["ts"])

    def phase_now(self) -> str:
        """The loop's innermost phase open now ("" between phases)."""
        return self._open[-1] if self._open else ""

    def document(self) -> dict[str, Any]:
        return {"traceEvents": self.events(), "displayTimeUnit": "ms",
                "otherData": {"producer": "rayless", "dropped_events": self.dropped,
                              "max_events_per_group": self.max_events_per_group}}

    def write(self) -> Path | None:
        """Replace `path` with every event kept (atomically: a temporary file renamed over it)."""
        if self.path is None:
            return None
        write_atomically(self.path, json.dumps(self.document(), separators=(",", ":")))
        return self.path


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@contextmanager
def recording(timeline: Timeline) -> Iterator[Timeline]:
    """Make `timeline` the current one for this task and every task it starts from here on."""
    token = _CURRENT.set(timeline)
    try:
        yield timeline
    finally:
        _CURRENT.reset(token)


def current() -> Timeline | None:
    return _CURRENT.get()


def span(name: str, track: tuple[str, str | None] = PHASES, *, lanes: bool = False,
         **args: Any) -> AbstractContextManager[None]:
    """`with span("train"):` records on the current timeline; a no-op when the run records none."""
    timeline = _CURRENT.get()
    return nullcontext() if timeline is None else timeline.span(name, track, lanes=lanes, **args)


def ranks_trained(step_times: Iterable[Iterable[float]], rollout_id: int) -> None:
    """Each rank's optimizer steps of one train call, as the ranks reported their times (`step_time_s`),
    laid back to back so the last ends now, when the reply came."""
    timeline = _CURRENT.get()
    if timeline is None:
        return
    ended = time.monotonic()
    for rank, times in enumerate(step_times):
        times = list(times)
        at = ended - sum(times)
        for index, seconds in enumerate(times):
            timeline.complete("train step", at, seconds, ("train ranks", f"rank {rank}"), rank=rank,
                              step=index, rollout_id=rollout_id)
            at += seconds


def at_step(rollout_id: int, weight_version: str) -> None:
    """Tag the events that follow with this rollout id and weight version (no timeline: nothing)."""
    timeline = _CURRENT.get()
    if timeline is not None:
        timeline.at_step(rollout_id, weight_version)


async def step_done(rollout_id: int, started: float, seconds: float) -> None:
    """The step of `rollout_id` took `seconds` from `started`: record it and rewrite the file (the document is
    copied here, between awaits; serialising and writing it runs in a worker thread)."""
    timeline = _CURRENT.get()
    if timeline is None:
        return
    timeline.complete("step", started, seconds, STEPS, rollout_id=rollout_id)
    if timeline.path is not None:
        import anyio

        text = timeline.document()
        path = timeline.path
        await anyio.to_thread.run_sync(lambda: write_atomically(path, json.dumps(text, separators=(",", ":"))))
