"""metrics.jsonl across a resume: the rows of the steps a resumed run redoes are replaced, not repeated."""

from __future__ import annotations

from pathlib import Path

from coordinator.observe.progress import MetricsLog, read_metrics


def test_a_resume_replaces_the_rows_of_the_steps_it_redoes(tmp_path: Path) -> None:
    first = MetricsLog(tmp_path)
    for step in range(6):
        first.log(step, {"train/loss": float(step)})
    first.log(3, {"eval/skipped": 1.0})  # an eval of step 3, logged after step 5: step 3 is not redone
    first.close()  # the run crashed after step 5; its last checkpoint is rollout 3

    resumed = MetricsLog(tmp_path)
    assert resumed.resume_at(4) == 2  # the first run's rows of steps 4 and 5; its eval of step 3 stays
    for step in (4, 5, 6):
        resumed.log(step, {"train/loss": 10.0 + step})
    resumed.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows if "train/loss" in row] == [0, 1, 2, 3, 4, 5, 6]
    assert [row["train/loss"] for row in rows if row["step"] >= 4] == [14.0, 15.0, 16.0]
    assert [row["step"] for row in rows if "eval/skipped" in row] == [3]
    # the summary, the plot and the status readers read `history`: the whole run, each rollout once (step 3's
    # eval row is the file's only: in the history it stood for a rollout with no figures)
    assert [row["step"] for row in resumed.history] == [0, 1, 2, 3, 4, 5, 6]


def test_resuming_with_nothing_to_drop_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    log.log(0, {"x": 1.0})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    assert log.resume_at(1) == 0
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    log.log(1, {"x": 2.0})
    log.close()
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
