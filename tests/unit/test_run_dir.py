"""One run per run directory, and what `--load` names: a second run into a used `--run-dir` (or `--save`) is
refused at start-up with the three ways on; `--load` of a run directory resumes from the checkpoint its run
saved; `--overwrite-run-dir` removes only what a run wrote; the resume command is the run's own arguments with
`--load`. Checkpoints here are written by the ranks' own `save_checkpoint`, in one process."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch

from coordinator.checks.run_dir import check_run_dir, clear_run_dir
from coordinator.config import ConfigError, parse_config, write_resolved_config
from coordinator.config.checkpoint import checkpoint_rollout
from coordinator.lifecycle.resume import resume_command, resume_hint
from coordinator.observe.progress import MetricsLog
from workers.train_rank import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

ROOT = Path(__file__).resolve().parents[2]


def argv_for(tmp_path: Path, *flags: str, model: Path | None = None) -> list[str]:
    return ["--hf-checkpoint", str(model or tmp_path / "model"), "--prompt-data", "builtin:first_digit",
            "--rollout-num-engines", "1", "--rollout-batch-size", "2", "--num-rollout", "6",
            "--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt"), *flags]


def save(save_dir: Path, rollout_id: int) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ckpt.save_checkpoint(save_dir, rollout_id, model=model, optimizer=optimizer, scheduler=scheduler,
                         extra={"rollout_id": rollout_id})


def earlier_run(tmp_path: Path, *, steps: int, saved: list[int]) -> None:
    """What a run that logged `steps` rollouts and saved `saved` leaves behind."""
    config = parse_config(argv_for(tmp_path))
    write_resolved_config(config, tmp_path / "run")
    metrics = MetricsLog(tmp_path / "run")
    for step in range(steps):
        metrics.log(step, {"rollout/reward_mean": 0.1 * step})
    metrics.close()
    for rollout_id in saved:
        save(tmp_path / "ckpt", rollout_id)


def test_checkpoint_rollout_reads_what_the_ranks_would_load(tmp_path: Path) -> None:
    assert checkpoint_rollout(tmp_path / "ckpt") is None
    save(tmp_path / "ckpt", 3)
    save(tmp_path / "ckpt", 5)
    assert checkpoint_rollout(tmp_path / "ckpt") == 5 == ckpt.load_checkpoint(
        tmp_path / "ckpt", **_objects()).rollout_id
    assert checkpoint_rollout(tmp_path / "ckpt" / "rollout_3") == 3


def _objects() -> dict[str, object]:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": optimizer,
            "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)}


def test_a_second_run_into_a_used_run_directory_is_refused_with_the_choices(tmp_path: Path) -> None:
    earlier_run(tmp_path, steps=4, saved=[3])
    with pytest.raises(ConfigError) as refused:
        check_run_dir(parse_config(argv_for(tmp_path)))
    message = str(refused.value)
    assert f"--run-dir {tmp_path / 'run'} holds a run already (rollouts 0..3 in metrics.jsonl" in message
    assert f"--run-dir {tmp_path / 'run-2'}" in message  # a new directory
    assert f"--load {tmp_path / 'ckpt'} (its checkpoint of rollout 3)" in message  # continue it
    assert "--overwrite-run-dir" in message  # start over
    # the same with a new --run-dir but the earlier run's --save: its checkpoints would be mixed with the new ones
    with pytest.raises(ConfigError, match=r"--save .* holds the checkpoints of another run \(newest: rollout 3\)"):
        check_run_dir(parse_config([*argv_for(tmp_path), "--run-dir", str(tmp_path / "other")]))


def test_run_shs_default_job_is_given_run_shs_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`./run.sh` again: its user typed no flag, so the choices are what to type instead (run.sh sets the variable
    for its default job, whose --save lies in its run directory)."""
    earlier_run(tmp_path, steps=4, saved=[3])
    monkeypatch.setenv("RAYLESS_DEFAULT_JOB", "1")
    with pytest.raises(ConfigError) as refused:
        check_run_dir(parse_config(argv_for(tmp_path)))
    choices = str(refused.value).split("Choose one:\n", 1)[1].splitlines()
    assert choices == [f"  - a new run: RAYLESS_RUN_DIR={tmp_path / 'run-2'} ./run.sh",
                       f"  - continue it from its checkpoint of rollout 3: the `rayless train ... --load "
                       f"{tmp_path / 'ckpt'}` command it printed as it stopped",
                       f"  - start over: rm -r {tmp_path / 'run'} && ./run.sh"]
    # a run that finished has nothing to continue
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"outcome": "finished"}))
    with pytest.raises(ConfigError) as refused:
        check_run_dir(parse_config(argv_for(tmp_path)))
    assert "continue it" not in str(refused.value) and "  - start over: rm -r" in str(refused.value)
    assert "export RAYLESS_DEFAULT_JOB=1" in (ROOT / "run.sh").read_text()


def test_rayless_train_refuses_a_used_run_directory_with_exit_2_before_anything_launches(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.cli import train_main

    earlier_run(tmp_path, steps=3, saved=[2])
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "run").iterdir())
    assert train_main([*argv_for(tmp_path, model=tiny_model_dir), "--n-samples-per-prompt", "1"]) == 2
    err = capsys.readouterr().err
    assert "rayless train: error: --run-dir" in err and "holds a run already" in err
    assert "--run-dir" in err and f"--load {tmp_path / 'ckpt'}" in err and "--overwrite-run-dir" in err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "run").iterdir()) == before, \
        "nothing was launched or written"


def test_a_run_that_saved_nothing_cannot_be_continued_and_says_so(tmp_path: Path) -> None:
    earlier_run(tmp_path, steps=2, saved=[])
    with pytest.raises(ConfigError, match="continue that run: not possible: it saved no checkpoint"):
        check_run_dir(parse_config(argv_for(tmp_path)))


def test_load_of_a_run_directory_resumes_from_its_checkpoint_and_is_allowed_into_it(tmp_path: Path) -> None:
    earlier_run(tmp_path, steps=4, saved=[3])
    # the run directory holds a config.json, as a Hugging Face model does: it is told apart, not misread
    config = parse_config([*argv_for(tmp_path), "--load", str(tmp_path / "run")])
    plan = config.load_plan()
    assert plan.resume and plan.path == str(tmp_path / "ckpt") and plan.run_dir == str(tmp_path / "run")
    assert check_run_dir(config) == [f"--run-dir {tmp_path / 'run'}: continues the run there (rollouts 0..3 in "
                                     "metrics.jsonl)"]  # it stopped before writing its summary
    for load in (tmp_path / "ckpt", tmp_path / "ckpt" / "rollout_3"):  # a save directory, one checkpoint
        assert parse_config([*argv_for(tmp_path), "--load", str(load)]).load_plan().resume


def test_load_of_a_run_directory_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    earlier_run(tmp_path, steps=2, saved=[])
    config = parse_config([*argv_for(tmp_path), "--load", str(tmp_path / "run")])
    with pytest.raises(ConfigError, match=r"--load .*run: a run directory; its run saves to --save .* which holds no "
                                          "checkpoint"):
        config.load_plan()


def test_overwrite_removes_the_earlier_run_and_its_checkpoints_and_nothing_else(tmp_path: Path) -> None:
    earlier_run(tmp_path, steps=4, saved=[1, 3])
    (tmp_path / "run" / "notes.txt").write_text("mine")
    (tmp_path / "ckpt" / "README").write_text("mine")
    config = parse_config([*argv_for(tmp_path), "--overwrite-run-dir"])
    assert "will be removed as the run starts" in check_run_dir(config)[0]
    removed = clear_run_dir(tmp_path / "run", save=str(tmp_path / "ckpt"))
    assert "metrics.jsonl" in removed and "config.json" in removed
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["README"]
    assert check_run_dir(config) == [f"--overwrite-run-dir: {tmp_path / 'run'} holds no earlier run; nothing to "
                                     "remove"]
    save(tmp_path / "ckpt", 0)
    with pytest.raises(ConfigError, match=r"--overwrite-run-dir and --load .* contradict"):
        check_run_dir(parse_config([*argv_for(tmp_path), "--overwrite-run-dir", "--load", str(tmp_path / "ckpt")]))


def test_the_resume_command_is_the_runs_own_with_load(tmp_path: Path) -> None:
    argv = [*argv_for(tmp_path), "--load", "elsewhere", "--overwrite-run-dir", "--load=again", "--lr", "3e-3"]
    command = shlex.split(resume_command(argv, str(tmp_path / "ckpt")))
    assert command[:4] == [sys.executable, "-m", "coordinator.cli", "train"]
    assert command[4:] == [*argv_for(tmp_path), "--lr", "3e-3", "--load", str(tmp_path / "ckpt")]
    config = parse_config(argv_for(tmp_path))
    assert resume_hint(config, argv_for(tmp_path)) == f"no checkpoint in --save {tmp_path / 'ckpt'} yet: nothing " \
                                                      "to resume from"
    assert resume_hint(config, argv_for(tmp_path), stopped=False) is None  # a failure's own message is enough
    save(tmp_path / "ckpt", 2)
    hint = resume_hint(config, argv_for(tmp_path))
    assert hint is not None and hint.startswith(f"to resume from the checkpoint of rollout 2 ({tmp_path / 'ckpt'})")
    assert hint.splitlines()[1].strip() == resume_command(argv_for(tmp_path), str(tmp_path / "ckpt"))


def test_a_resumed_runs_history_is_the_whole_run_each_rollout_once(tmp_path: Path) -> None:
    """What summary.json and rewards.png are made of after a resume at rollout 2 of a run that had logged 0..3."""
    earlier_run(tmp_path, steps=4, saved=[1])
    resumed = MetricsLog(tmp_path / "run")
    assert resumed.resume_at(2) == 2
    for step in range(2, 6):
        resumed.log(step, {"rollout/reward_mean": 1.0})
    resumed.close()
    assert [row["step"] for row in resumed.history] == list(range(6))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(6))
    assert [row["rollout/reward_mean"] for row in rows] == [0.0, 0.1, 1.0, 1.0, 1.0, 1.0]
