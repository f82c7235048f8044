"""The loop watchdog (coordinator/observe/watchdog.py): a loop blocked by user code is named while it is blocked,
with its stack and the loop's tasks once, then with back-off; the lag shows the stall; a healthy loop says
nothing."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from types import ModuleType

import anyio
import pytest

from coordinator.observe.progress import MetricsLog
from coordinator.observe.watchdog import LoopWatchdog, is_user_code
from coordinator.status.prometheus import render

pytestmark = pytest.mark.anyio

BLOCKER = '''
import time


def grade_slowly(seconds):
    time.sleep(seconds)  # a synchronous call inside an async reward function: the loop is blocked
    return 1.0
'''


def user_module(tmp_path: Path) -> ModuleType:
    path = tmp_path / "my_reward.py"
    path.write_text(BLOCKER)
    spec = importlib.util.spec_from_file_location("my_reward", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_user_code_is_told_from_rayless_and_libraries(tmp_path: Path) -> None:
    assert is_user_code(str(tmp_path / "my_reward.py"))
    assert not is_user_code(str(sys.modules[LoopWatchdog.__module__].__file__))
    assert not is_user_code(json.__file__)  # the standard library
    assert not is_user_code(anyio.__file__)  # site-packages
    assert not is_user_code("<string>")


async def test_a_blocked_loop_is_named_while_blocked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    module = user_module(tmp_path)
    caplog.set_level(logging.WARNING, logger="rayless.watchdog")
    watchdog = LoopWatchdog(0.5)
    async with anyio.create_task_group() as group:
        await group.start(watchdog.run)

        async def waiting_task() -> None:
            await anyio.sleep(3600)

        group.start_soon(waiting_task, name="a-probe-task")
        await anyio.sleep(0.3)  # a few ticks of a healthy loop
        assert not watchdog.reports and watchdog.stats.stalls == 0
        blocked_at = time.time()
        module.grade_slowly(2.4)  # blocks the loop: reports at 0.5, 1 and 2 s of the stall
        unblocked_at = time.time()
        await anyio.sleep(0.3)  # the watchdog task runs again and records the lag
        group.cancel_scope.cancel()

    records = [r for r in caplog.records if r.name == "rayless.watchdog"]
    assert records, "nothing logged while the loop was blocked"
    first = records[0]
    assert blocked_at < first.created < unblocked_at, "the stall was reported after it had ended"
    text = first.getMessage()
    assert f"user code grade_slowly at {tmp_path / 'my_reward.py'}:6" in text
    assert "blocking stack (innermost last)" in text and "test_a_blocked_loop_is_named_while_blocked" in text
    assert "a-probe-task: sleep" in text, text  # the loop's task tree, each task with the frame it waits in
    # the same stall again, backed off (0.5, 1, 2 s), without repeating the stack; one stall counted
    assert 2 <= len(records) <= 3 and all("blocking stack" not in r.getMessage() for r in records[1:])
    assert watchdog.stats.stalls == 1
    assert watchdog.stats.max_s >= 2.0, watchdog.stats
    # a step's row takes the window's largest lag, then the window starts again from the latest lag
    assert watchdog.stats.take_window_max() >= 2.0
    assert watchdog.stats.take_window_max() < 2.0


async def test_two_stalls_are_two_and_a_healthy_loop_is_quiet(tmp_path: Path) -> None:
    module = user_module(tmp_path)
    watchdog = LoopWatchdog(0.3)
    async with anyio.create_task_group() as group:
        await group.start(watchdog.run)
        await anyio.sleep(1.0)
        assert watchdog.stats.stalls == 0 and not watchdog.reports
        module.grade_slowly(0.7)
        await anyio.sleep(0.3)
        module.grade_slowly(0.7)
        await anyio.sleep(0.3)
        group.cancel_scope.cancel()
    assert watchdog.stats.stalls == 2
    assert sum("blocking stack" in report for report in watchdog.reports) == 2


def test_the_lag_reaches_metrics_rows_and_prometheus(tmp_path: Path) -> None:
    metrics = MetricsLog(tmp_path)
    metrics.row_sources.append(lambda: {"perf/loop_lag_max_s": 1.5})
    metrics.log(0, {"rollout/reward_mean": 0.5})
    metrics.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["perf/loop_lag_max_s"] == 1.5 and row["rollout/reward_mean"] == 0.5
    document = {"run": {"rollouts_done": 1, "num_rollout": 2, "elapsed_s": 3.0, "eta_s": None,
                        "weight_version": "1", "loop_lag_s": 0.01, "loop_lag_max_s": 1.5, "loop_stalls": 1},
                "engines": [], "ranks": [], "metrics": []}
    text = render(document).decode()
    assert "rayless_loop_lag_seconds 0.01" in text and "rayless_loop_lag_max_seconds 1.5" in text
    assert "rayless_loop_stalls_total 1.0" in text


def test_the_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--loop-stall-warn-s"):
        LoopWatchdog(0)
