"""Train FT end to end: a rank stopped mid-run (SIGSTOP: it never answers) is killed at its command's deadline
(`--rank-call-timeout-s`), restarted by torchrun, reloaded from the last checkpoint and sent the step again;
every rollout completes and the engines are never relaunched. Without train FT the same
kill ends the run with a RankFailure naming the rank: that run replays the FT run's dumps, as the kill needs
no engine (one engine process fewer)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from coordinator.config import parse_config
from coordinator.run import run_training
from coordinator.services import Services
from coordinator.train.errors import RankFailure

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


class RankKiller:
    """Hook: signal rank 0's process right after the step of `at_rollout` (between steps): SIGKILL, like a
    crash, or SIGSTOP, a rank that stops answering."""

    def __init__(self, services: Services, at_rollout: int, sig: signal.Signals = signal.SIGKILL) -> None:
        self.services = services
        self.at_rollout = at_rollout
        self.sig = sig
        self.killed: list[int] = []
        self.engine_incarnations: list[dict[str, int]] = []

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        if self.services.fleet is not None:  # a replay has no engines
            self.engine_incarnations.append({h.name: h.incarnation for h in self.services.fleet.engines})
        if rollout_id == self.at_rollout:
            pid = self.services.train_group.ranks[0].pid
            os.kill(pid, self.sig)
            self.killed.append(pid)


def train_config(model_dir: Path, tmp_path: Path, *flags: str) -> Any:
    return parse_config([
        "--hf-checkpoint", str(model_dir), "--actor-num-gpus-per-node", "1", "--prompt-data", "builtin:first_digit",
        "--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--run-dir", str(tmp_path / "run"), "--no-progress",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "1", *flags,
    ])


class Messages(logging.Handler):
    """The messages of the run's narrative logger ("rayless") while a module fixture runs (caplog is per test)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@dataclass
class FtRun:
    summary: dict[str, Any]
    killer: RankKiller
    services: Services
    ft_enabled: tuple[bool, bool]
    messages: list[str]
    dumps: str


@pytest.fixture(scope="module")
def ft_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FtRun:
    tmp_path = tmp_path_factory.mktemp("train-ft")
    dumps = str(tmp_path / "dumps" / "{rollout_id}.rld")
    config = train_config(tiny_model_dir, tmp_path, "--engine-backend", "cpu", "--rollout-num-engines", "1",
                          "--sglang-server-concurrency", "8", "--save-debug-rollout-data", dumps,
                          "--use-fault-tolerance", "--ft-components", "train", "--max-restarts", "2",
                          "--rank-call-warn-s", "1", "--rank-call-timeout-s", "2")
    killers: list[RankKiller] = []
    seen: list[Services] = []

    def hooks(services: Services) -> list[Any]:
        seen.append(services)
        killers.append(RankKiller(services, at_rollout=0, sig=signal.SIGSTOP))
        return killers

    handler = Messages()
    logger = logging.getLogger("rayless")
    logger.addHandler(handler)
    try:
        summary = anyio.run(lambda: run_training(config, extra_hooks=hooks))
    finally:
        logger.removeHandler(handler)
    return FtRun(summary, killers[0], seen[0], (config.train_ft_enabled, config.rollout_ft_enabled),
                 handler.messages, dumps)


def test_a_stopped_rank_is_killed_at_its_deadline_restarted_and_the_run_completes_without_touching_engines(
        ft_run: FtRun) -> None:
    assert ft_run.ft_enabled == (True, False)  # train FT on, rollout FT off
    summary, killer = ft_run.summary, ft_run.killer
    assert killer.killed, "the hook stopped rank 0"
    (deadline,) = [m for m in ft_run.messages if "passed its deadline" in m]
    assert f"rank 0 (pid {killer.killed[0]}, stopped)" in deadline and "killed them: train FT restarts" in deadline
    assert summary["rollouts"] == 3 and summary["train_steps"] == 3 and summary["final_weight_version"] == "3"
    assert summary["train_recoveries"] == 1
    ft = summary["ft"]
    assert ft["monitors"] == [] and not ft["injection_armed"] and ft["weight_sync_recoveries"] == 0
    # engines stayed up with their weights: never relaunched
    assert len(killer.engine_incarnations) == 3  # one per step
    assert all(inc == {"rollout-0": 1} for inc in killer.engine_incarnations)
    assert ft_run.services.fleet.engines[0].incarnation == 1
    assert "--max-restarts" in ft_run.services.train_group.torchrun_command()
    # the restarted rank was given the last checkpoint (rollout 0's) before the step was sent again
    assert any("ranks are back from checkpoint" in m and "rollout_0" in m for m in ft_run.messages), ft_run.messages


async def test_without_train_ft_a_killed_rank_ends_the_run_naming_it(ft_run: FtRun, tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    # the FT run's dumps replayed: the kill after rollout 0 ends it at rollout 1's step
    config = train_config(tiny_model_dir, tmp_path, "--load-debug-rollout-data", ft_run.dumps)

    def hooks(services: Services) -> list[Any]:
        return [RankKiller(services, at_rollout=0)]

    with pytest.raises((RankFailure, BaseExceptionGroup)) as raised:  # type: ignore[arg-type]
        await run_training(config, extra_hooks=hooks)
    error = raised.value
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, RankFailure) and error.ranks == [0]
    assert "training rank(s) 0 failed" in str(error)
