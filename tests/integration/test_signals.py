"""Signals to a running coordinator: real `rayless train` subprocesses (CPU engines, the router, torchrun and
its gloo ranks) signalled mid-run.

SIGTERM and SIGHUP stop the run the way Ctrl-C does: exit status 128 + signal, one line naming the signal,
every launched process gone, and the ranks stopped by their shutdown command (train_ranks.log ends clean).
With `--save`, SIGTERM first ends the step in flight and saves it, and the run prints the command that resumes
it: run as printed, that command continues with the numbers an uninterrupted run has (the crash-resume test's
exactness, `test_train_e2e`), and `rayless status` calls the stopped run interrupted.
SIGKILL leaves the coordinator no say: its children end by themselves (the lifeline, `workers/lifeline.py`)
within seconds. (A clean run's train_ranks.log: `test_train_e2e`.) Every check first asserts that the run had
launched each kind of process, so none can pass on a run that launched nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import psutil
import pytest

from coordinator.config import parse_config
from coordinator.config.checkpoint import checkpoint_rollout
from coordinator.lifecycle.processes import terminate_process_group_blocking
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from coordinator.status import command as status_command
from replay.format import dump_path
from replay.reader import read_dump
from tests.integration.test_startup_progress import assert_a_start_shown_in_order
from tests.support.processes import STOP_BOUND_S, alive, wait_gone
from tests.support.waiting import wait_until_sync

#: No process of the run is left this long after the signal: the bound the code enforces (tests/support/processes.py;
#: how long a stop takes is measured in bench/soak.py).
GONE_WITHIN_S = STOP_BOUND_S
#: With --save the run first ends the step in flight and saves it (docs/running.md, "Stopping and resuming"); a
#: tiny model's step and save take a second or two, and summary.json and rewards.png are written after the stop
#: (seconds on a loaded 2-core machine): 30 s more than a stop without a save is given.
SAVED_WITHIN_S = STOP_BOUND_S + 30.0


def run_args(model: Path, run_dir: Path, *flags: str, ranks: int = 1, rollouts: int = 100000,
             batch: tuple[int, int] = (2, 2)) -> list[str]:
    """A long `rayless train`'s arguments: one engine, `ranks` ranks, `batch` (prompts, samples per prompt) a
    rollout (4 samples: one process of each kind is what the stop checks need)."""
    return ["--hf-checkpoint", str(model), "--prompt-data", "builtin:first_digit", "--rm-type", "first_digit",
            "--rollout-num-engines", "1", "--actor-num-gpus-per-node", str(ranks), "--rollout-batch-size",
            str(batch[0]), "--n-samples-per-prompt", str(batch[1]), "--num-rollout", str(rollouts),
            "--rollout-max-response-len", "4", "--run-dir", str(run_dir), "--no-progress", *flags]


def start_run(model: Path, run_dir: Path, *flags: str, ranks: int = 1,
              batch: tuple[int, int] = (2, 2)) -> tuple[subprocess.Popen[bytes], Path]:
    """`run_args`' run in its own process group; stderr into a file read afterwards."""
    command = [sys.executable, "-m", "coordinator.cli", "train",
               *run_args(model, run_dir, *flags, ranks=ranks, batch=batch)]
    return start_command(command, run_dir.parent / f"{run_dir.name}.stderr")


def start_command(command: list[str], stderr: Path, cwd: Path | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, cwd=cwd)
    return proc, stderr


def wait_training(proc: subprocess.Popen[bytes], run_dir: Path, stderr: Path, timeout: float = 240.0,
                  step: int = 0) -> None:
    """Until rollout `step`'s metrics are written (engines, ranks and router are all up by then)."""
    metrics = run_dir / "metrics.jsonl"

    def trained() -> bool:
        if metrics.exists() and any(row["step"] >= step for row in read_metrics(metrics)):
            return True
        assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{stderr.read_text()[-3000:]}"
        return False

    try:
        wait_until_sync(trained, timeout=timeout, interval=0.2, what=f"rollout {step}'s metrics")
    except AssertionError as error:
        if proc.poll() is not None:
            raise
        raise AssertionError(f"{error}:\n{stderr.read_text()[-3000:]}") from None


def the_runs_processes(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The coordinator's descendants now; psutil.Process keeps each one's identity (pid and start time)."""
    return psutil.Process(proc.pid).children(recursive=True)


def command_lines(processes: list[psutil.Process]) -> str:
    lines = []
    for process in processes:
        try:
            lines.append(" ".join(process.cmdline()))
        except psutil.Error:
            continue
    return "\n".join(lines)


def end_leftovers(proc: subprocess.Popen[bytes], processes: list[psutil.Process]) -> None:
    """A failed check must not leave the run behind for the rest of the session."""
    if proc.poll() is None:
        terminate_process_group_blocking(proc, grace=1.0)
    for process in alive(processes):
        try:
            process.kill()
        except psutil.Error:
            continue


def assert_every_kind_launched(processes: list[psutil.Process], *, router: bool, ranks: int = 1) -> None:
    """One engine, torchrun and its `ranks` ranks (and the router) among the run's processes; the lifeline's
    watchers (which carry their command's arguments) not counted."""
    lines = [line for line in command_lines(processes).splitlines() if "lifeline.py" not in line]
    every = "\n".join(lines)
    assert sum("-m workers.engine" in line for line in lines) == 1, every
    assert sum("-m torch.distributed.run" in line for line in lines) == 1, every
    assert sum(line.endswith("-m workers.train_rank") and "torch.distributed.run" not in line
               for line in lines) == ranks, every
    if router:  # the router names itself sglang::router once started
        assert any("sglang::router" in line or "sglang_router" in line for line in lines), every


def stop_and_check(proc: subprocess.Popen[bytes], run_dir: Path, stderr: Path, sig: signal.Signals, *,
                   router: bool, ranks: int, step: int = 0, within: float = GONE_WITHIN_S) -> str:
    """Once rollout `step` is trained: `sig` to the run, which must exit 128 + `sig` within `within` seconds with
    every process it launched gone, the signal named, no traceback, the ranks stopped cleanly. Its stderr."""
    processes: list[psutil.Process] = []
    try:
        wait_training(proc, run_dir, stderr, step=step)
        processes = the_runs_processes(proc)
        assert_every_kind_launched(processes, router=router, ranks=ranks)
        signalled = time.monotonic()
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=within)
        left = wait_gone(processes, timeout=signalled + within - time.monotonic())
        assert not left, command_lines(left)
    finally:
        end_leftovers(proc, processes)
    err = stderr.read_text()
    assert code == 128 + sig, err[-3000:]
    assert f"INFO {sig.name} received; every launched process was stopped" in err  # a stop asked for: no ERROR
    assert "Traceback" not in err and " ERROR " not in err, err[-3000:]
    ranks_log = (run_dir / "train_ranks.log").read_text()
    assert "ChildFailedError" not in ranks_log and "Traceback" not in ranks_log, ranks_log[-3000:]
    return err


def test_sighup_stops_every_process_and_exits_128_plus_the_signal(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With the router and two ranks (torchrun stops both cleanly); no --save: the signal stops the run at once."""
    run_dir = tmp_path / "run"
    proc, stderr = start_run(tiny_model_dir, run_dir, "--use-sglang-router", ranks=2)
    err = stop_and_check(proc, run_dir, stderr, signal.SIGHUP, router=True, ranks=2)
    assert "cannot be resumed" in err  # no --save: said, rather than a command that would start over


def rollout_numbers(run_dir: Path) -> list[tuple[int, str, float, float]]:
    """Each metrics row's (step, weight version, reward, loss): what a resume must continue exactly."""
    return [(row["step"], row["weight_version"], row["rollout/reward_mean"], row["train/loss"])
            for row in read_metrics(run_dir / "metrics.jsonl")]


def assert_no_torch_imported(importtime_stderr: str) -> None:
    """Issue 36: a resuming coordinator (checkpoint checks, tokenizer, engines' and ranks' start, training, the
    save on SIGTERM) imports no torch; its `-X importtime` lines show the tokenizer was loaded in it all the same.
    (importtime logs `import` statements, not `importlib.import_module`; torch's own modules import each other by
    statement, so a torch import by either way shows.)"""
    modules = re.findall(r"^import time:\s+\d+ \|\s+\d+ \| *(\S+)$", importtime_stderr, re.M)
    assert {"coordinator.services", "coordinator.data.tokenizer", "transformers.tokenization_utils_base"} <= set(
        modules), modules[-50:]
    assert [name for name in modules if name.split(".")[0] == "torch"] == []


def test_sigterm_with_save_saves_the_step_and_its_printed_command_resumes_it_exactly(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    run_dir, save = tmp_path / "run", tmp_path / "ckpt"
    dumps = "{rollout_id}.rld"
    training = ("--rollout-shuffle", "--lr", "3e-3", "--save", str(save), "--save-interval", "1000")
    batch = (8, 8)  # 64 samples: some earn a reward, so the policy (and every number after it) moves
    proc, stderr = start_run(tiny_model_dir, run_dir, *training, "--save-debug-rollout-data",
                             str(tmp_path / "dumps" / dumps), batch=batch)
    err = stop_and_check(proc, run_dir, stderr, signal.SIGTERM, router=False, ranks=1, step=2,
                         within=SAVED_WITHIN_S)
    assert_a_start_shown_in_order(err, run_dir, rollouts=100000)  # what a person saw start (test_startup_progress)
    # the step in flight ended (or was abandoned), the last one trained was saved: the checkpoint holds the last row
    last = rollout_numbers(run_dir)[-1][0]
    assert [row[0] for row in rollout_numbers(run_dir)] == list(range(last + 1))
    assert checkpoint_rollout(save) == last and f"saved checkpoint of rollout {last} to {save}" in err
    status = io.StringIO()
    with contextlib.redirect_stdout(status):
        assert status_command.main([str(run_dir)]) == 0
    assert f"run {run_dir}: interrupted · {last + 1}/100000 rollouts" in status.getvalue()
    assert "ETA" not in status.getvalue(), "an ended run has no ETA to show"

    found = re.search(r"to resume from the checkpoint of rollout (\d+) \((.+)\), run from (.+):\n  (.+)\n", err)
    assert found is not None, err[-3000:]
    assert (int(found[1]), found[2]) == (last, str(save))
    # as printed, from where it says: the same run, continued in the same run directory; its interpreter run with
    # -X importtime (not passed to children), so the resumed coordinator's stderr lists every module it imported
    resumed_at = time.time()
    program = shlex.join([sys.executable, "-m", "coordinator.cli"])
    assert found[4].startswith(program + " train "), found[4]
    timed = shlex.join([sys.executable, "-X", "importtime", "-m", "coordinator.cli"]) + found[4][len(program):]
    resumed, resumed_err = start_command(["bash", "-c", "exec " + timed], tmp_path / "resumed.stderr",
                                         cwd=Path(found[3]))
    stop_and_check(resumed, run_dir, resumed_err, signal.SIGTERM, router=False, ranks=1, step=last + 2,
                   within=SAVED_WITHIN_S)
    assert f"continuing at rollout {last + 1}" in resumed_err.read_text()
    assert_no_torch_imported(resumed_err.read_text())
    numbers = rollout_numbers(run_dir)
    assert [row[0] for row in numbers] == list(range(len(numbers))), "each rollout once, in order"
    # the summary (and rewards.png, drawn from the same rows) covers the whole run, not the resumed part alone
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["outcome"], summary["start_rollout"]) == ("interrupted", last + 1)
    assert summary["reward_first"] == [row[2] for row in numbers[:3]]
    assert (run_dir / "rewards.png").stat().st_mtime >= resumed_at  # redrawn by the resumed run

    # an uninterrupted run of as many rollouts has the same numbers
    reference_dir = tmp_path / "reference"
    config = parse_config(run_args(tiny_model_dir, reference_dir, *training, "--save-debug-rollout-data",
                                   str(reference_dir / "dumps" / dumps), rollouts=len(numbers), batch=batch))
    anyio.run(run_training, config)
    expected = rollout_numbers(reference_dir)
    assert [row[:2] for row in numbers] == [row[:2] for row in expected]
    for got, want in zip(numbers, expected, strict=True):
        assert got[2:] == pytest.approx(want[2:], abs=1e-6), (numbers, expected)
    # the resumed rollouts' prompts and sampled tokens are the uninterrupted run's: the data position and the
    # weights the checkpoint restored (they had moved: some step before it trained on a reward)
    assert any(row[3] != 0.0 for row in numbers[:last + 1]), "no step before the stop trained: weights untested"
    for rollout_id in range(last + 1, len(numbers)):
        resumed_samples = read_dump(dump_path(str(tmp_path / "dumps" / dumps), rollout_id)).samples
        reference_samples = read_dump(dump_path(str(reference_dir / "dumps" / dumps), rollout_id)).samples
        assert [(s.metadata["prompt_index"], s.tokens) for s in resumed_samples] == \
            [(s.metadata["prompt_index"], s.tokens) for s in reference_samples]


def test_children_of_a_sigkilled_coordinator_end_by_themselves(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Saving every rollout, so the kill lands during or between saves: whatever `latest` then names is a
    complete, verified checkpoint whose step has its metrics row (a save is published only after the row)."""
    run_dir = tmp_path / "run"
    save_dir = tmp_path / "ckpt"
    proc, stderr = start_run(tiny_model_dir, run_dir, "--use-sglang-router", "--save", str(save_dir),
                             "--save-interval", "1")
    processes: list[psutil.Process] = []
    try:
        wait_training(proc, run_dir, stderr)
        wait_until_sync(lambda: (save_dir / "latest").exists() or proc.poll() is not None, timeout=60,
                        interval=0.05, what="the first published checkpoint")
        processes = the_runs_processes(proc)
        assert_every_kind_launched(processes, router=True)
        proc.kill()
        proc.wait(timeout=5)
        left = wait_gone(processes, timeout=GONE_WITHIN_S)
        assert not left, command_lines(left)
    finally:
        end_leftovers(proc, processes)
    logs = [*(run_dir / "logs").glob("engine-*.log"), run_dir / "logs" / "router-rollout.log",
            run_dir / "train_ranks.log"]
    assert len(logs) == 3
    for log in logs:  # each watcher says why it stopped its process group
        assert "rayless: the coordinator is gone; stopping process group" in log.read_text(), log
    from workers.train_rank.checkpoint import resolve_checkpoint
    from workers.train_rank.checkpoint_files import verify_checkpoint

    saved = verify_checkpoint(resolve_checkpoint(save_dir)).rollout_id
    rows = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert set(range(saved + 1)) <= set(rows), (saved, rows)
