"""The start-up board (one line per change of phase, secrets masked), the run-level ETA, and the live view's
rendering (rich, drawn into a recording console)."""

from __future__ import annotations

import logging

import pytest

from coordinator.observe.progress import ProgressDisplay, RunProgress, clock
from coordinator.observe.startup import StartupBoard


def test_the_board_logs_each_change_of_phase_once_and_masks_details(caplog: pytest.LogCaptureFixture) -> None:
    board = StartupBoard(mask=lambda text: text.replace("SECRET", "***"))
    board.expect("rollout-0", "GPU 4 · port 30001")
    with caplog.at_level(logging.INFO, logger="rayless"):
        board.phase("rollout-0", "starting", "pid 1")
        board.phase("rollout-0", "loading", "Load weight begin SECRET")
        board.phase("rollout-0", "loading", "Load weight end")  # same phase: kept, not logged
        board.phase("rollout-0", "healthy")
    lines = [record.getMessage() for record in caplog.records]
    assert [line.split("] ")[1].split(" (")[0] for line in lines] == ["starting", "loading", "healthy"]
    assert lines[0].startswith("start-up: rollout-0 [GPU 4 · port 30001] starting")
    assert "***" in lines[1] and "SECRET" not in "".join(lines)
    assert board.waiting() == []
    board.phase("train-ranks", "connected 1/2")
    assert [row.name for row in board.waiting()] == ["train-ranks"]
    assert "train-ranks connected 1/2" in board.waiting_line()


def test_the_eta_is_the_mean_time_per_rollout_times_those_left(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("coordinator.observe.progress.time.monotonic", lambda: now[0])
    run = RunProgress()
    run.begin(first=2, total=12)  # resumed at rollout 2: 10 rollouts to run
    assert run.eta() is None and "ETA ?" in run.text()
    now[0] = 130.0
    run.rollout_done(4)  # rollouts 2, 3, 4 done in 30 s
    assert run.done == 3 and run.remaining == 7 and run.eta() == pytest.approx(70.0)
    assert run.text(width=12).startswith("━━━━━─────── 5/12 rollouts  elapsed 0:00:30  ETA 0:01:10")
    assert clock(3725) == "1:02:05"


def test_the_live_view_shows_waiting_processes_the_run_bar_and_the_current_rollout() -> None:
    from rich.console import Console

    display = ProgressDisplay(enabled=True)
    display.board.expect("rollout-0", "GPU 4 · port 30001")
    display.board.phase("rollout-0", "loading", "Load weight begin")
    display.board.expect("train-ranks", "GPU 0-3 · 4 rank(s)")
    display.board.phase("train-ranks", "ready")
    display.run.begin(0, 10)

    class Line:
        def line(self) -> str:
            return "accepted 12/32 groups"

    console = Console(record=True, width=120)
    assert display.current is None
    with display("rollout 0", Line()):
        assert display.current is not None and display.current[0] == "rollout 0"
        console.print(display.render())
    assert display.current is None
    text = console.export_text()
    assert "rollout-0" in text and "loading" in text and "Load weight begin" in text
    assert "train-ranks" not in text  # ready: no longer waited for
    assert "0/10 rollouts" in text and "rollout 0  accepted 12/32 groups" in text
