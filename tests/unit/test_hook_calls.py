"""`coordinator.hooks.calls` and what rewards make of it: a hook's blocking call never holds a stop up, and what a
hook raises that is not an `Exception` (exit, interrupt, its own CancelledError) is an escape the hook kind
handles — a reward's costs its samples (FAILED, 0.0, counted) — while a cancellation of ours still propagates.
Every call is bounded: past its kind's limit it ends as a `HookTimeout`, and failures in a row of one kind spend
a budget that stops the run (`HookBudgetSpent`) naming the hook, the count and the last error.
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

from coordinator.hooks.calls import (
    HookBounds,
    HookBudgetSpent,
    HookEscaped,
    HookTimeout,
    call_hook,
    hook_bounds,
)
from coordinator.hooks.runtime import HookRuntime, current_call, hook_call
from coordinator.rollout.rewards import RewardModel
from replay.sample import Sample, SampleStatus

#: How long a blocked hook here would block: what "does not wait for it" is told from. A bound a tenth of it
#: separates the two on any machine, where a few seconds could be missed by a loaded one.
BLOCKS_S = 600.0
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
        await call_hook(fn, error, what="my.hook", kind="filter")
    assert escaped.value.original is error
    assert isinstance(escaped.value, Exception)  # what a hook kind's `except Exception` handles
    with pytest.raises(ValueError, match="plain"):  # an Exception is the hook kind's to handle, unchanged
        await call_hook(fn, ValueError("plain"), what="my.hook", kind="filter")


async def test_a_sync_hook_runs_in_a_worker_thread_inside_its_hook_call() -> None:
    import argparse

    runtime = HookRuntime(args=argparse.Namespace())
    seen: dict[str, Any] = {}

    def hook(x: int, *, y: int) -> int:
        seen["thread"] = threading.current_thread() is not threading.main_thread()
        seen["call"] = current_call()
        return x + y

    with hook_call(runtime, "route-1"):
        assert await call_hook(hook, 1, y=2, what="h", kind="filter") == 3
    assert seen["thread"] and seen["call"] is not None and seen["call"].route_token == "route-1"


async def test_a_stop_does_not_wait_for_a_blocked_sync_hook_and_names_it(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    entered = threading.Event()

    def blocked() -> None:
        entered.set()
        release.wait(BLOCKS_S)

    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(functools.partial(call_hook, blocked, what="--custom-rm-path 'slow.rm'",
                                                  kind="reward"))
                await anyio.to_thread.run_sync(entered.wait, 30)
                started = time.monotonic()
                scope.cancel()
        assert scope.cancelled_caught, "our cancellation propagated out of the hook call"
        assert time.monotonic() - started < BLOCKS_S / 10
        assert "--custom-rm-path 'slow.rm' was still running after" in caplog.text
    finally:
        release.set()  # the abandoned thread ends with the test


async def test_our_cancellation_of_an_async_hook_propagates() -> None:
    with anyio.move_on_after(0.2) as scope:
        await call_hook(anyio.sleep_forever, what="h", kind="filter")
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

    assert await call_hook(hook, what="h", kind="filter") == 42


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_a_hook_that_hangs_ends_at_its_kinds_limit_naming_it_and_the_flag(asynchronous: bool) -> None:
    release = threading.Event()

    def hangs() -> None:
        release.wait(BLOCKS_S)

    async def ahangs() -> None:
        await anyio.sleep_forever()

    try:
        with hook_bounds(HookBounds(limits={"reward": 0.3})):
            started = time.monotonic()
            with pytest.raises(HookTimeout, match=r"my\.rm did not return within 0\.3 s \(--custom-rm-timeout-s\)"):
                await call_hook(ahangs if asynchronous else hangs, what="my.rm", kind="reward")
            assert time.monotonic() - started < BLOCKS_S / 10
    finally:
        release.set()


async def test_a_reward_past_its_limit_fails_its_sample_only() -> None:
    async def score(sample: Sample) -> float:
        if sample.sample_index == 2:
            await anyio.sleep_forever()
        return 1.0

    with hook_bounds(HookBounds(limits={"reward": 0.2})):
        model = RewardModel(custom_rm=score)
        samples = group()
        await model.score_group(samples)
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0] and model.failed == 1
    assert samples[2].status is SampleStatus.FAILED


async def test_failures_in_a_row_spend_the_budget_and_one_return_starts_it_over(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    bounds = HookBounds(max_in_a_row=3)
    with hook_bounds(bounds):
        for _ in range(2):
            with pytest.raises(HookEscaped):
                await call_hook(sync_raiser, SystemExit(1), what="my.gen", kind="generate")
        assert await call_hook(lambda: 7, what="my.gen", kind="generate") == 7  # a return: the count starts over
        for _ in range(2):
            with pytest.raises(HookEscaped):
                await call_hook(async_raiser, KeyboardInterrupt(), what="my.gen", kind="generate")
        with pytest.raises(HookBudgetSpent, match=r"my\.gen failed 3 times in a row .*last: my\.gen raised "
                           r"KeyboardInterrupt") as spent:
            await call_hook(async_raiser, KeyboardInterrupt(), what="my.gen", kind="generate")
        assert spent.value.count == 3 and not isinstance(spent.value, HookEscaped)  # no kind's handler eats it
        # a call failing at the same moment as the one that spent the budget is an ordinary failure: the run
        # stops once, with one line
        with pytest.raises(HookEscaped):
            await call_hook(async_raiser, KeyboardInterrupt(), what="my.gen", kind="generate")
        assert bounds.in_a_row == {"generate": 4}
        # an ordinary Exception is the hook kind's contract: not counted here
        with pytest.raises(ValueError):
            await call_hook(sync_raiser, ValueError("x"), what="my.rm", kind="reward")
        assert bounds.in_a_row.get("reward", 0) == 0
    assert caplog.text.count("traceback of the first failure of my.gen") == 1  # the traceback once, in the log


async def test_an_uncounted_call_leaves_the_judgement_to_its_caller() -> None:
    bounds = HookBounds(max_in_a_row=2)
    with hook_bounds(bounds):
        await call_hook(lambda: None, what="my.agent", kind="agent", counted=False)
        bounds.failed("agent", "my.agent", "its episode made no model call")
        await call_hook(lambda: None, what="my.agent", kind="agent", counted=False)
        with pytest.raises(HookBudgetSpent, match=r"my\.agent failed 2 times in a row .*last: its episode made no "
                           "model call"):
            bounds.failed("agent", "my.agent", "its episode made no model call")
