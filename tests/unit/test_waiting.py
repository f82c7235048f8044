"""The suite's `wait_until`: it returns the value once the condition holds, and on timeout says what it waited
for and the last value it saw; a failing read fails at once unless told to ignore it."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import pytest

from tests.support.waiting import wait_until, wait_until_sync


async def test_returns_the_first_value_the_condition_accepts_set_by_another_task() -> None:
    counter = [0]

    async def count() -> None:
        for _ in range(5):
            await anyio.sleep(0.01)
            counter[0] += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(count)
        assert await wait_until(lambda: counter[0], until=lambda n: n >= 3, timeout=10, what="3 counts") >= 3


async def test_an_awaitable_read_is_awaited() -> None:
    async def read() -> str:
        await anyio.lowlevel.checkpoint()
        return "ready"

    assert await wait_until(read, timeout=10, what="a ready read") == "ready"


async def test_a_timeout_names_what_was_awaited_and_the_last_value_seen() -> None:
    with pytest.raises(AssertionError, match=r"after 0.1 s waiting for 5 probes; last seen: 2$"):
        await wait_until(lambda: 2, until=lambda n: n >= 5, timeout=0.1, what="5 probes")


async def test_an_ignored_error_is_retried_and_reported_any_other_fails_at_once() -> None:
    with pytest.raises(AssertionError, match=r"last seen: ConnectionError\('refused'\)"):
        await wait_until(lambda: (_ for _ in ()).throw(ConnectionError("refused")), timeout=0.1,
                         what="an answer", ignoring=(ConnectionError,))
    reads = [0]

    def dead() -> bool:
        reads[0] += 1
        raise AssertionError("the process exited")

    with pytest.raises(AssertionError, match="the process exited"):
        await wait_until(dead, timeout=10, what="never")
    assert reads == [1]


def test_the_sync_version_waits_for_a_thread_and_times_out_the_same_way() -> None:
    done = threading.Event()
    timer = threading.Timer(0.05, done.set)
    timer.start()
    try:
        assert wait_until_sync(done.is_set, timeout=10, what="the timer") is True
    finally:
        timer.join()
    with pytest.raises(AssertionError, match=r"waiting for a file; last seen: False$"):
        wait_until_sync(lambda: False, timeout=0.1, what="a file")
