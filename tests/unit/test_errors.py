"""One base class for known failures: each is reported by its message alone, anything else with its traceback."""

from __future__ import annotations

import json
import logging

import pytest

from coordinator.config import ConfigError
from coordinator.data.source import DataSourceError
from coordinator.engines.errors import EngineHTTPError, EngineStreamError, EngineTimeout, EngineUnreachable
from coordinator.engines.launch import EngineLaunchError
from coordinator.engines.router import RouterError
from coordinator.lifecycle.failures import FILE_ONLY, ToFileOnly, is_user_facing, log_failure, user_code_frame
from coordinator.rollout.advantages import AdvantageError
from coordinator.rollout.dispatch import NoEngineAvailable
from coordinator.rollout.filters import FilterError
from coordinator.rollout.manager import NotBuiltError
from coordinator.rollout.rewards import RewardError
from coordinator.run import RunFailed
from coordinator.train.errors import RankCommandError, RankFailure
from coordinator.weights.sync import WeightSyncError
from replay.format import DumpError
from replay.loader import ReplayMissingError
from workers.errors import RaylessError
from workers.hook_loading import HookLoadError

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
    from coordinator.engines.spec import EngineLaunchSpec

    log = logging.getLogger("rayless.test")
    with caplog.at_level(logging.ERROR, logger="rayless.test"):
        log_failure(log, NoEngineAvailable("every rollout engine is dead; see runs/x/logs"))
        try:
            EngineLaunchSpec(kind="bogus", model_path="m")  # raised by our own code: a bug's report
        except ValueError as error:
            log_failure(log, error)
    known, unknown = caplog.records
    assert known.getMessage() == "run failed: NoEngineAvailable: every rollout engine is dead; see runs/x/logs"
    formatter = logging.Formatter()
    assert known.exc_info is None and "\n" not in formatter.format(known)
    assert unknown.exc_info is not None and "Traceback" in formatter.format(unknown)
    assert not getattr(unknown, FILE_ONLY, False)


def _users_helper() -> None:
    raise KeyError("surprise")


def test_the_users_code_raising_is_one_line_naming_it_with_the_traceback_for_the_file_only(
        caplog: pytest.LogCaptureFixture) -> None:
    """This test module is not in our packages nor a library: to the rule, it is the user's code (a hook)."""
    log = logging.getLogger("rayless.test")
    with caplog.at_level(logging.ERROR, logger="rayless.test"):
        try:
            _users_helper()
        except KeyError as error:
            log_failure(log, error)
    line, trace = caplog.records
    assert line.exc_info is None and line.getMessage().startswith(
        f"run failed: KeyError: 'surprise', raised by your code at {__file__}:")
    assert "(in _users_helper); fix it there" in line.getMessage()
    assert trace.exc_info is not None and getattr(trace, FILE_ONLY) is True
    assert not ToFileOnly().filter(trace) and ToFileOnly().filter(line)


def test_a_library_raising_inside_the_users_code_names_the_users_line() -> None:
    def users_hook() -> None:
        json.loads("{")  # the standard library raises; the user's line is where to look

    try:
        users_hook()
    except ValueError as error:
        frame = user_code_frame(error)
    assert frame is not None and frame.name == "users_hook" and frame.filename == __file__


class _Lines(logging.Handler):
    """A handler keeping what it would write, as the run's file or terminal handler would format it."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def test_a_contained_failure_is_one_terminal_line_and_a_count_and_every_traceback_in_the_file() -> None:
    from coordinator.lifecycle.failures import ContainedFailures

    log = logging.getLogger("rayless.test.contained")
    log.propagate = False
    file, terminal = _Lines(), _Lines()
    terminal.addFilter(ToFileOnly())
    log.handlers = [file, terminal]
    failures = ContainedFailures(log)
    for index in range(12):
        try:
            raise RuntimeError("verifiers rollout failed: " + "x" * 1000)
        except RuntimeError as error:
            failures.report("--custom-agent-function-path examples.agents:run", f"sample {index}/0", error)
    assert len(terminal.lines) == 2 and not any("Traceback" in line for line in terminal.lines)
    assert terminal.lines[0].startswith("--custom-agent-function-path examples.agents:run failed on sample 0/0: "
                                        "RuntimeError: verifiers rollout failed: xxx")
    assert "x" * 300 not in terminal.lines[0], "a long error is cut on the terminal"
    assert terminal.lines[1] == ("--custom-agent-function-path examples.agents:run: 10 failures with RuntimeError "
                                 "so far (each in the run's coordinator.log)")
    assert sum("Traceback" in line for line in file.lines) == 12


def test_a_library_registered_file_only_reaches_the_file_alone() -> None:
    from coordinator.lifecycle.failures import file_only_logger

    library = logging.getLogger("rayless_test_library")
    library.addHandler(logging.StreamHandler())  # its own stderr handler, as verifiers installs one
    library.propagate = False
    file_only_logger("rayless_test_library")
    assert library.handlers == [] and library.propagate
    file, terminal = _Lines(), _Lines()
    terminal.addFilter(ToFileOnly())
    root = logging.getLogger()
    root.addHandler(file)
    root.addHandler(terminal)
    try:
        logging.getLogger("rayless_test_library.envs").error("Aborted rollout due to EmptyModelResponseError()")
        logging.getLogger("rayless_test_library_other").error("another library")
    finally:
        root.removeHandler(file)
        root.removeHandler(terminal)
    assert file.lines == ["Aborted rollout due to EmptyModelResponseError()", "another library"]
    assert terminal.lines == ["another library"]
