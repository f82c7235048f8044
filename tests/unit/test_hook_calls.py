"""`coordinator.hooks.calls` and what rewards make of it: a hook's blocking call never holds a stop up, and what a
hook raises that is not an `Exception` (exit, interrupt, its own CancelledError) is an escape the hook kind
handles — a reward's costs its samples (FAILED, 0.0, counted) — while a cancellation of ours still propagates.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from coordinator.hooks.calls import HookEscaped, call_hook
from coordinator.hooks.runtime import HookRuntime, current_call, hook_call
from coordinator.rollout.rewards import RewardModel
from replay.sample import Sample, SampleStatus

ESCAPES = [SystemExit(4), KeyboardInterrupt(), GeneratorExit(), asyncio.CancelledError()]


def sync_raiser(error: BaseException) -> Any:
    raise error


async def async_raiser(error: BaseException) -> Any:
    await anyio.lowlevel.checkpoint()
    raise error


@pytest.mark.parametrize("error", ESCAPES, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("fn", [sync_raiser, async_raiser])
async def test_what_is_not_an_exception_comes_out_as_an_escape_naming_the_hook(fn: Any, error: BaseException) -> None:
    with pytest.raises(HookEscaped, match=f"my.hook raised {type(error).__name__}") as escaped:
        await call_hook(fn, error, what="my.hook")
    assert escaped.value.original is error
    assert isinstance(escaped.value, Exception)  # what a hook kind's `except Exception` handles
    with pytest.raises(ValueError, match="plain"):  # an Exception is the hook kind's to handle, unchanged
        await call_hook(fn, ValueError("plain"), what="my.hook")


async def test_a_sync_hook_runs_in_a_worker_thread_inside_its_hook_call() -> None:
    import argparse

    runtime = HookRuntime(args=argparse.Namespace())
    seen: dict[str, Any] = {}

    def hook(x: int, *, y: int) -> int:
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        seen["call"] = current_call()
        return x + y

    with hook_call(runtime, "route-1"):
        assert await call_hook(hook, 1, y=2, what="h") == 3
    assert seen["thread"] and seen["call"] is not None and seen["call"].route_token == "route-1"


async def test_a_stop_does_not_wait_for_a_blocked_sync_hook_and_names_it(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    entered = threading.Event()

    def blocked() -> None:
        entered.set()
        release.wait(600)

    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(functools.partial(call_hook, blocked, what="--custom-rm-path 'slow.rm'"))
                await anyio.to_thread.run_sync(entered.wait, 30)
                started = time.monotonic()
                scope.cancel()
        assert scope.cancelled_caught, "our cancellation propagated out of the hook call"
        assert time.monotonic() - started < 5
        assert "--custom-rm-path 'slow.rm' was still running after" in caplog.text
    finally:
        release.set()  # the abandoned thread ends with the test


async def test_our_cancellation_of_an_async_hook_propagates() -> None:
    with anyio.move_on_after(0.2) as scope:
        await call_hook(anyio.sleep_forever, what="h")
    assert scope.cancelled_caught


def group(n: int = 3) -> list[Sample]:
    return [Sample(prompt="p", tokens=[1, 2, 3], response="r", response_length=1, label="1", group_index=0,
                   sample_index=k, status=SampleStatus.COMPLETED) for k in range(n)]


@pytest.mark.parametrize("error", ESCAPES, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_reward_that_escapes_fails_its_sample_only(error: BaseException, asynchronous: bool,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)

    def score(sample: Sample) -> float:
        if sample.sample_index == 1:
            raise error
        return 1.0

    async def ascore(sample: Sample) -> float:
        return score(sample)

    model = RewardModel(custom_rm=ascore if asynchronous else score)
    samples = group()
    await model.score_group(samples)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert [s.status for s in samples] == [SampleStatus.COMPLETED, SampleStatus.FAILED, SampleStatus.COMPLETED]
    assert model.failed == 1
    assert f"raised {type(error).__name__}" in caplog.text and "sample 0/1 failed (status failed, reward 0.0)" in caplog.text


async def test_a_group_reward_that_escapes_fails_the_group_and_an_exception_still_stops_the_run() -> None:
    model = RewardModel(custom_rm=lambda samples: sync_raiser(SystemExit(0)), group_rm=True)
    samples = group()
    await model.score_group(samples)
    assert all(s.status is SampleStatus.FAILED and s.reward == 0.0 for s in samples) and model.failed == 3
    with pytest.raises(ZeroDivisionError):
        await RewardModel(custom_rm=lambda sample: 1 / 0).score_group(group())


async def test_slimes_run_coro_works_from_a_sync_hook_in_its_thread() -> None:
    from coordinator.hooks import run

    async def answer() -> int:
        await anyio.lowlevel.checkpoint()
        return 42

    def hook() -> int:
        return run(answer())  # slime's async_utils.run: on the run's event loop, from the worker thread

    assert await call_hook(hook, what="h") == 42
