"""Stop signals, sent for real to this process: the first goes to the handler the training loop arms while it
can end cleanly (the run goes on to save), a second stops the run at once; with no handler armed the first
signal cancels the run, as before the loop starts or after it ends."""

from __future__ import annotations

import os
import signal

import anyio
import pytest

from coordinator.lifecycle.signals import StopSignals, run_until_signalled

pytestmark = pytest.mark.anyio


async def test_the_first_signal_goes_to_the_armed_handler_and_a_second_stops_at_once() -> None:
    stop = StopSignals()
    handled: list[signal.Signals] = []
    asked = anyio.Event()
    ended: list[str] = []

    def handler(sig: signal.Signals) -> str:
        handled.append(sig)
        asked.set()
        return "saving"

    async def main() -> None:
        with stop.handled_by(handler):
            os.kill(os.getpid(), signal.SIGTERM)
            await asked.wait()
            ended.append("handled: the run goes on")
            os.kill(os.getpid(), signal.SIGINT)
            await anyio.sleep_forever()  # cancelled by the second signal
        ended.append("not reached")

    with anyio.fail_after(10):
        await run_until_signalled(main, stop)
    assert handled == [signal.SIGTERM] and stop.handled
    assert stop.received == [signal.SIGTERM, signal.SIGINT] and stop.first == signal.SIGTERM
    assert ended == ["handled: the run goes on"]


async def test_with_no_handler_armed_the_first_signal_cancels_the_run() -> None:
    stop = StopSignals()
    handled: list[signal.Signals] = []

    async def main() -> None:
        with stop.handled_by(lambda sig: handled.append(sig) or ""):
            pass  # the loop has ended: its handler is disarmed
        os.kill(os.getpid(), signal.SIGHUP)
        await anyio.sleep_forever()

    with anyio.fail_after(10):
        await run_until_signalled(main, stop)
    assert handled == [] and not stop.handled and stop.received == [signal.SIGHUP]
