"""One base class for known failures: each is reported by its message alone, anything else with its traceback."""

from __future__ import annotations

import logging

import pytest

from coordinator.config import ConfigError
from coordinator.engines.client import EngineHTTPError, EngineStreamError, EngineTimeout, EngineUnreachable
from coordinator.engines.launch import EngineLaunchError
from coordinator.engines.router import RouterError
from coordinator.failures import is_user_facing, log_failure
from coordinator.rollout.advantages import AdvantageError
from coordinator.rollout.data_source import DataSourceError
from coordinator.rollout.dispatch import NoEngineAvailable
from coordinator.rollout.filters import FilterError
from coordinator.rollout.loading import HookLoadError
from coordinator.rollout.manager import NotBuiltError
from coordinator.rollout.rewards import RewardError
from coordinator.run import RunFailed
from coordinator.train.errors import RankCommandError, RankFailure
from coordinator.weight_sync import WeightSyncError
from replay.format import DumpError
from replay.loader import ReplayMissingError
from workers.errors import RaylessError

KNOWN = [ConfigError("--lr: must be ≥ 0"), RunFailed("x"), RankFailure([1], "exited"), WeightSyncError("x"),
         NoEngineAvailable("x"), NotBuiltError("x"), RewardError("x"), DataSourceError("x"), HookLoadError("x"),
         RouterError("x"), EngineHTTPError(400, "bad", "http://e"), EngineStreamError(500, "x", "http://e"),
         EngineUnreachable("http://e", "refused"), EngineTimeout("http://e", 5.0, "read timeout"), FilterError("x"),
         AdvantageError("x"), EngineLaunchError("exited", name="e", log_path=None, log_tail="", returncode=1)]


@pytest.mark.parametrize("error", KNOWN, ids=lambda error: type(error).__name__)
def test_every_known_failure_is_a_user_facing_rayless_error(error: Exception) -> None:
    assert isinstance(error, RaylessError) and is_user_facing(error)


def test_historical_bases_still_catch_them() -> None:
    assert isinstance(ConfigError("x"), ValueError) and isinstance(RunFailed("x"), RuntimeError)
    assert isinstance(HookLoadError("x"), ValueError) and isinstance(RankFailure([0], "x"), RuntimeError)
    assert issubclass(RankCommandError, RaylessError)


def test_replay_errors_are_known_without_replay_importing_the_base() -> None:
    assert is_user_facing(DumpError("bad checksum")) and is_user_facing(ReplayMissingError("no dump"))
    assert not issubclass(DumpError, RaylessError)  # replay imports no package of ours


def test_a_subclass_can_declare_itself_a_bug() -> None:
    class InternalInvariantBroken(RaylessError):
        user_facing = False

    assert not is_user_facing(InternalInvariantBroken("x")) and not is_user_facing(KeyError("x"))


def test_known_failures_are_logged_as_one_line_and_others_with_their_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("rayless.test")
    with caplog.at_level(logging.ERROR, logger="rayless.test"):
        log_failure(log, NoEngineAvailable("every rollout engine is dead; see runs/x/logs"))
        try:
            raise KeyError("surprise")
        except KeyError as error:
            log_failure(log, error)
    known, unknown = caplog.records
    assert known.getMessage() == "run failed: NoEngineAvailable: every rollout engine is dead; see runs/x/logs"
    formatter = logging.Formatter()
    assert known.exc_info is None and "\n" not in formatter.format(known)
    assert unknown.exc_info is not None and "Traceback" in formatter.format(unknown)
