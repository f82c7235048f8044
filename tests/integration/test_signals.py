"""Signals to a running coordinator: real `rayless train` subprocesses (CPU engines, the router, torchrun and
its gloo ranks) signalled mid-run.

SIGTERM and SIGHUP stop the run the way Ctrl-C does: exit status 128 + signal, one line naming the signal,
every launched process gone, and the ranks stopped by their shutdown command (train_ranks.log ends clean).
SIGKILL leaves the coordinator no say: its children end by themselves (the lifeline, `workers/lifeline.py`)
within seconds. (A clean run's train_ranks.log: `test_train_e2e`.) Every check first asserts that the run had launched each kind of process, so none can pass on
a run that launched nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from coordinator.lifecycle.processes import terminate_process_group_blocking
from tests.support.waiting import wait_until_sync

#: The issue's bound: no process of the run is left this long after the signal.
GONE_WITHIN_S = 10.0


def start_run(model: Path, run_dir: Path, *flags: str, ranks: int = 1) -> tuple[subprocess.Popen[bytes], Path]:
    """A long `rayless train` (one engine, `ranks` ranks, 4 samples a rollout: one process of each kind is
    what the checks need) in its own process group; stderr into a file read afterwards."""
    stderr = run_dir.parent / f"{run_dir.name}.stderr"
    command = [sys.executable, "-m", "coordinator.cli", "train", "--hf-checkpoint", str(model),
               "--prompt-data", "builtin:first_digit", "--rm-type", "first_digit", "--rollout-num-engines", "1",
               "--actor-num-gpus-per-node", str(ranks), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
               "--num-rollout", "100000", "--rollout-max-response-len", "4", "--run-dir", str(run_dir),
               "--no-progress", *flags]
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    return proc, stderr


def wait_training(proc: subprocess.Popen[bytes], run_dir: Path, stderr: Path, timeout: float = 240.0) -> None:
    """Until the first rollout's metrics are written (engines, ranks and router are all up by then)."""
    metrics = run_dir / "metrics.jsonl"

    def trained() -> bool:
        if metrics.exists() and metrics.stat().st_size > 0:
            return True
        assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{stderr.read_text()[-3000:]}"
        return False

    try:
        wait_until_sync(trained, timeout=timeout, interval=0.2, what="the first rollout's metrics")
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


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
        except psutil.NoSuchProcess:
            continue
    return left


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still alive after waiting up to `timeout` for all to be gone (the caller asserts)."""
    with contextlib.suppress(AssertionError):
        wait_until_sync(lambda: alive(processes), until=lambda left: not left, timeout=timeout, interval=0.1,
                        what="the run's processes gone")
    return alive(processes)


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


# SIGTERM with the router and two ranks (torchrun stops both cleanly), SIGHUP with neither
@pytest.mark.parametrize(("sig", "router", "ranks"), [(signal.SIGTERM, True, 2), (signal.SIGHUP, False, 1)])
def test_a_stop_signal_stops_every_process_and_exits_128_plus_the_signal(
        tiny_model_dir: Path, tmp_path: Path, sig: signal.Signals, router: bool, ranks: int) -> None:
    run_dir = tmp_path / "run"
    proc, stderr = start_run(tiny_model_dir, run_dir, *(["--use-sglang-router"] if router else []), ranks=ranks)
    processes: list[psutil.Process] = []
    try:
        wait_training(proc, run_dir, stderr)
        processes = the_runs_processes(proc)
        assert_every_kind_launched(processes, router=router, ranks=ranks)
        signalled = time.monotonic()
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=GONE_WITHIN_S)
        left = wait_gone(processes, timeout=signalled + GONE_WITHIN_S - time.monotonic())
        assert not left, command_lines(left)
    finally:
        end_leftovers(proc, processes)
    err = stderr.read_text()
    assert code == 128 + sig, err[-3000:]
    assert f"{sig.name} received; every launched process was stopped" in err
    assert "Traceback" not in err
    ranks_log = (run_dir / "train_ranks.log").read_text()
    assert "ChildFailedError" not in ranks_log and "Traceback" not in ranks_log, ranks_log[-3000:]


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
