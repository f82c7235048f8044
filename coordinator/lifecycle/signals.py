"""Stop signals: SIGINT (Ctrl-C), SIGTERM (what SLURM, Kubernetes and `timeout` send) and SIGHUP (a closed
terminal) stop a run the same way.

Owns `run_until_signalled`: it runs the run's main function beside a task that receives these signals
through anyio's signal receiver. Invariants: the first signal is recorded and cancels the main's scope, so
every service ends its processes on its own (shielded) exit path rather than the interpreter dying; the
receiver stays up until the main has returned, so a second signal is logged and changes nothing (its default
action would kill the coordinator in the middle of that cleanup).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

log = logging.getLogger("rayless")

#: The signals that stop a run; its exit status is then 128 + the signal's number.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


async def run_until_signalled(main: Callable[[], Awaitable[object]], stopped_by: list[signal.Signals]) -> None:
    """`await main()`, cancelled by the first of `STOP_SIGNALS` (appended to `stopped_by`)."""
    main_scope = anyio.CancelScope()
    async with anyio.create_task_group() as group:
        await group.start(_stop_on_signal, main_scope, stopped_by)
        with main_scope:
            await main()
        group.cancel_scope.cancel()


async def _stop_on_signal(main_scope: anyio.CancelScope, stopped_by: list[signal.Signals], *,
                          task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    with anyio.open_signal_receiver(*STOP_SIGNALS) as received:
        task_status.started()
        async for number in received:
            name = signal.Signals(number).name
            if stopped_by:
                log.warning("%s received again: already stopping every launched process", name)
                continue
            stopped_by.append(signal.Signals(number))
            log.warning("%s received: stopping every launched process", name)
            main_scope.cancel()
