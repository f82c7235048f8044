"""What the node registry refused, logged at a bounded rate: the first refusal of an interval in full (a
misconfigured node is named at once), the rest of it counted into one summary line.

Owns `RefusalLog`. Invariant: however many connections a flood opens, the log gets at most two lines per
`interval_s`, `recent` holds at most `keep` reasons, and `total` counts every refusal.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

import anyio
import anyio.abc

log = logging.getLogger("rayless")


class RefusalLog:
    def __init__(self, *, interval_s: float = 10.0, keep: int = 100) -> None:
        self.interval_s = interval_s
        self.recent: deque[str] = deque(maxlen=keep)
        self.total = 0
        self._logged_at = -float("inf")
        self._held: Counter[str] = Counter()

    def note(self, peer: str, reason: str, *, kind: str | None = None) -> None:
        """One refused connection from `peer`; `kind` groups it in the summary (default: the reason)."""
        self.total += 1
        self.recent.append(f"{peer}: {reason}")
        now = time.monotonic()
        if now - self._logged_at >= self.interval_s and not self._held:
            self._logged_at = now
            log.warning("node registry refused a connection from %s: %s", peer, reason)
        else:
            self._held[kind or reason] += 1

    def flush(self) -> None:
        """The summary line of what was held back since the last line, if anything was."""
        if self._held:
            held, self._held = self._held, Counter()
            self._logged_at = time.monotonic()
            parts = ", ".join(f"{count} {kind}" for kind, count in held.most_common(5))
            log.warning("node registry refused %d more connections in the last %g s: %s",
                        sum(held.values()), self.interval_s, parts)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Flush every interval until cancelled (then once more)."""
        task_status.started()
        try:
            while True:
                await anyio.sleep(self.interval_s)
                self.flush()
        finally:
            self.flush()
