"""Stop signals: SIGINT (Ctrl-C), SIGTERM (what SLURM, Kubernetes and `timeout` send) and SIGHUP (a closed
terminal) stop a run the same way.

Owns `run_until_signalled` and `StopSignals`: the run's main function runs beside a task that receives these
signals through anyio's signal receiver. The first signal is recorded (`StopSignals.received`) and either
handed to the handler armed at that moment (`StopSignals.handled_by`: the training loop arms one while it can
end cleanly — finish the step in flight, save, return) or, with none armed, cancels the main's scope, so every
service ends its processes on its own (shielded) exit path rather than the interpreter dying. A second signal
after a handled first one cancels the main's scope (stop at once, without waiting for the save); any signal
after the scope is cancelled is logged and changes nothing (its default action would kill the coordinator in
the middle of that cleanup). The receiver stays up until the main has returned.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

log = logging.getLogger("rayless")

#: The signals that stop a run; its exit status is then 128 + the signal's number.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignals:
    """The stop signals a run received, and who acts on the first one."""

    def __init__(self) -> None:
        #: every stop signal received, in order
        self.received: list[signal.Signals] = []
        self._handler: Callable[[signal.Signals], str] | None = None
        #: whether the first signal went to a handler (the run then ends by itself, cleanly)
        self.handled = False

    @property
    def first(self) -> signal.Signals | None:
        return self.received[0] if self.received else None

    @contextmanager
    def handled_by(self, handler: Callable[[signal.Signals], str]) -> Iterator[None]:
        """While inside: the first stop signal calls `handler(signal)` (which returns what the run will now do,
        for the log line) instead of cancelling the run."""
        self._handler = handler
        try:
            yield
        finally:
            self._handler = None

    def _hand_over(self, number: signal.Signals) -> bool:
        if self._handler is None:
            return False
        self.handled = True
        what = self._handler(number)
        log.warning("%s received: %s (send it again to stop at once, without saving)", number.name, what)
        return True


async def run_until_signalled(main: Callable[[], Awaitable[object]], stop: StopSignals) -> None:
    """`await main()`; the first of `STOP_SIGNALS` goes to `stop`'s armed handler or cancels it."""
    main_scope = anyio.CancelScope()
    async with anyio.create_task_group() as group:
        await group.start(_stop_on_signal, main_scope, stop)
        with main_scope:
            await main()
        group.cancel_scope.cancel()


async def _stop_on_signal(main_scope: anyio.CancelScope, stop: StopSignals, *,
                          task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    with anyio.open_signal_receiver(*STOP_SIGNALS) as received:
        task_status.started()
        async for number in received:
            sig = signal.Signals(number)
            first = not stop.received
            stop.received.append(sig)
            if first and stop._hand_over(sig):
                continue
            if main_scope.cancel_called:
                log.warning("%s received again: already stopping every launched process", sig.name)
                continue
            log.warning("%s received: stopping every launched process%s", sig.name,
                        "" if first else " now, without saving")
            main_scope.cancel()
