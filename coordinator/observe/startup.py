"""Start-up phases of the launched processes, as a person watching the terminal follows them.

Owns the `PhaseObserver` protocol that launchers report to (engines: starting → loading → healthy; the
training ranks: starting → connected n/N → loading → ready; the router: starting → healthy; any of them:
failed) and `StartupBoard`, which keeps the latest phase of each process, logs every change of phase as one
line, and says who is still being waited for. Rendering it live is `coordinator.observe.progress`'s business.

Invariants: a launcher never needs an observer (`NO_OBSERVER` ignores everything); the board never shows a
secret (every detail passes through its mask before it is kept); a change of phase is logged once, a new
detail within the same phase (an engine's latest log line) is kept for the live view but not logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger("rayless")

#: Phases after which a process is no longer waited for.
DONE_PHASES = frozenset({"healthy", "ready"})
_DETAIL_CHARS = 100


class PhaseObserver(Protocol):
    def phase(self, name: str, phase: str, detail: str = "") -> None:
        """`name` (e.g. "rollout-0", "train-ranks") entered `phase`; `detail` says more (one line)."""
        ...


class _NoObserver:
    def phase(self, name: str, phase: str, detail: str = "") -> None:
        return None


NO_OBSERVER: PhaseObserver = _NoObserver()


@dataclass
class ProcessStatus:
    name: str
    #: where it runs, from the plan: "GPU 4 · port 35001"
    where: str = ""
    phase: str = "planned"
    detail: str = ""
    #: when it entered this phase / when it was first seen starting (time.monotonic)
    since: float = field(default_factory=time.monotonic)
    started: float | None = None

    @property
    def done(self) -> bool:
        return self.phase in DONE_PHASES

    def elapsed(self, now: float | None = None) -> float:
        return (now or time.monotonic()) - (self.started if self.started is not None else self.since)


class StartupBoard:
    """The phase of every launched process. Launchers call `phase()`; the display reads `rows()`."""

    def __init__(self, *, mask: Callable[[str], str] | None = None, log_changes: bool = True) -> None:
        self.mask = mask or (lambda text: text)
        self.log_changes = log_changes
        self._rows: dict[str, ProcessStatus] = {}
        self.started = time.monotonic()

    def expect(self, name: str, where: str) -> None:
        """A process the plan will launch, shown as `planned` until its launcher reports."""
        self._rows.setdefault(name, ProcessStatus(name=name, where=where))

    def phase(self, name: str, phase: str, detail: str = "") -> None:
        row = self._rows.setdefault(name, ProcessStatus(name=name))
        detail = self.mask(" ".join(detail.split()))[:_DETAIL_CHARS]
        now = time.monotonic()
        if phase == row.phase:
            row.detail = detail
            return
        if phase == "starting" or row.started is None:
            row.started = now
        row.phase, row.detail, row.since = phase, detail, now
        if self.log_changes:
            level = logging.WARNING if phase == "failed" else logging.INFO
            log.log(level, "%s", self.change_line(row, now))

    def change_line(self, row: ProcessStatus, now: float | None = None) -> str:
        where = f" [{row.where}]" if row.where else ""
        detail = f": {row.detail}" if row.detail else ""
        return f"start-up: {row.name}{where} {row.phase} ({row.elapsed(now):.1f} s){detail}"

    def rows(self) -> list[ProcessStatus]:
        return list(self._rows.values())  # one C-level copy: the live view reads it from rich's thread

    def waiting(self) -> list[ProcessStatus]:
        return [row for row in self.rows() if not row.done]

    def waiting_line(self) -> str:
        """One line naming who is still being waited for, and how far each got."""
        now = time.monotonic()
        parts = [f"{row.name} {row.phase} {row.elapsed(now):.0f}s" + (f" ({row.detail})" if row.detail else "")
                 for row in self.waiting()]
        return f"start-up {now - self.started:.0f}s: waiting for " + "; ".join(parts)
