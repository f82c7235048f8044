"""A training rank that stops answering (SIGSTOP mid-run: a wedged GPU or a deadlocked collective looks the same
from the coordinator) is named within its bound, with every process's stacks collected automatically; the run
goes on once the rank does. Stopped again, and never let go, the command's deadline ends the run (no train FT)
with one `RankOverdue` naming the command, the rank and the time waited. One rank, replaying small dumps: no
engine is started."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from coordinator.config import parse_config
from coordinator.lifecycle.processes import leaf_exceptions
from coordinator.observe.rank_watch import RankOverdue
from coordinator.run import run_training
from coordinator.services import Services
from tests.support.replay_inputs import write_sample_dump
from tests.support.waiting import wait_until

pytestmark = pytest.mark.anyio

ROLLOUTS = 3


async def test_a_stopped_rank_is_named_with_the_stacks(tiny_model_dir: Path, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    for rollout_id in range(ROLLOUTS):
        write_sample_dump(tmp_path / "dumps" / f"{rollout_id}.rld", rollout_id=rollout_id)
    run_dir = tmp_path / "run"
    config = parse_config([
        "--hf-checkpoint", str(tiny_model_dir), "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "3",
        "--n-samples-per-prompt", "2", "--load-debug-rollout-data", str(tmp_path / "dumps" / "{rollout_id}.rld"),
        "--num-rollout", str(ROLLOUTS), "--run-dir", str(run_dir), "--no-progress", "--rank-call-warn-s", "1",
        "--rank-call-timeout-s", "2",
    ])
    caplog.set_level(logging.WARNING, logger="rayless")
    stopped: list[int] = []

    class StopTheRank:
        def __init__(self, services: Services) -> None:
            self.services = services

        async def after_step(self, rollout_id: int, weight_version: str) -> None:
            if rollout_id in (0, 1):  # let go after the first stop; the second lasts until the deadline
                assert self.services.train_group is not None
                pid = self.services.train_group.ranks[0].pid
                os.kill(pid, signal.SIGSTOP)  # the next train command waits on it
                stopped.append(pid)

    def hooks(services: Services) -> list[Any]:
        return [StopTheRank(services)]

    async def let_it_go_once_named() -> None:
        await wait_until(lambda: list((run_dir / "stacks").glob("dump-*.txt")), timeout=120,
                         what="the stacks collected for the stopped rank")
        os.kill(stopped[0], signal.SIGCONT)

    try:
        with pytest.raises(BaseExceptionGroup) as failed:
            async with anyio.create_task_group() as group:
                group.start_soon(let_it_go_once_named)
                await run_training(config, extra_hooks=hooks)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    pid = stopped[0]
    warnings = [r.getMessage() for r in caplog.records if "command has waited" in r.getMessage()]
    assert warnings, "the stopped rank was never named"
    assert "'train' command has waited" in warnings[0] and f"rank 0 (pid {pid}, stopped)" in warnings[0]
    # the first warning names the first dump (their names are timestamps; on a loaded machine the stopped rank
    # may be warned about again before the test lets it go, so there may be more than one by now)
    first_dump = min((run_dir / "stacks").glob("dump-*.txt"))
    assert str(first_dump) in warnings[0]
    dump = first_dump.read_text()
    assert "event loop tasks ===" in dump  # the coordinator answered while the rank could not
    assert "no answer within" in dump and f"rank0 (pid {pid}, stopped)" in dump
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2, "the run did not go on once the rank did, or did not stop at the second stop"

    (overdue,) = [error for error in leaf_exceptions(failed.value) if isinstance(error, RankOverdue)]
    message = str(overdue)
    assert "\n" not in message and "'train' command passed its deadline" in message, message
    assert f"rank 0 (pid {stopped[1]}, stopped)" in message and "--rank-call-timeout-s" in message
    # the deadline: --rank-call-timeout-s or 10x the longest earlier train command (not the first stop's: a
    # command warned about does not lengthen the next one's bound), met within the watch's tick and the stacks'
    # collection
    found = re.search(r"(\d+)s waited for .* \(deadline (\d+)s: --rank-call-timeout-s, or 10x", message)
    assert found, message
    waited, deadline = (float(number) for number in found.groups())
    # waited: at least the deadline; past it by the watch's poll and however slow a loaded machine is, but far from
    # anything a library would wait for (the process group's timeout is 600 s here, torch's default 30 min)
    assert 2 <= deadline <= waited < deadline + 120 and deadline < 60, message
    assert len(list((run_dir / "stacks").glob("dump-*.txt"))) >= 3  # 1st stop; 2nd: its warning and its deadline
