"""What a person sees while a run starts, in plain lines (`--no-progress`, or no terminal): every launched
process's phases in order, the run-level ETA beside each rollout's line, and the log tail of a process that
fails to start. Real `rayless train` subprocesses on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def train(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", "train", *args, "--no-progress"],
                          capture_output=True, text=True, timeout=timeout, check=False, env=env)


def phases(stderr: str, name: str) -> list[str]:
    """The phases `name` went through, in the order the start-up lines report them."""
    pattern = re.compile(rf"start-up: {re.escape(name)} \[[^\]]*\] (.+?) \(\d+\.\d s\)")
    return [match.group(1) for match in pattern.finditer(stderr)]


def test_a_cpu_run_shows_each_process_phases_in_order_and_an_eta(tiny_model_dir: Path, tmp_path: Path) -> None:
    result = train("--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "builtin:first_digit",
                   "--rm-type", "first_digit", "--rollout-num-engines", "1", "--actor-num-gpus-per-node", "1",
                   "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "3",
                   "--rollout-max-response-len", "4", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    err = result.stderr
    assert phases(err, "rollout-0") == ["starting", "loading", "healthy"], err
    assert phases(err, "train-ranks") == ["starting", "connected 1/1", "loading", "ready"], err
    assert "start-up: rollout-0 [CPU · port " in err and "start-up: train-ranks [CPU · 1 rank(s)]" in err
    # The plan comes first, then the processes start, then the rollouts, each with the run's elapsed and ETA.
    assert err.index("placement plan") < err.index("start-up: rollout-0") < err.index("rollout 0 (1 of 3)")
    rollout_lines = [line for line in err.splitlines() if re.search(r"rollout \d \(\d of 3\) ", line)]
    # each rollout named by its id, from 0 as metrics.jsonl and checkpoints name it, then the count done
    assert [re.search(r"rollout (\d) \((\d) of", line).groups() for line in rollout_lines] == [  # type: ignore[union-attr]
        ("0", "1"), ("1", "2"), ("2", "3")], err
    assert all(re.search(r"elapsed \d+:\d\d:\d\d  ETA \d+:\d\d:\d\d$", line) for line in rollout_lines), rollout_lines
    plan_text = (tmp_path / "run" / "plan.txt").read_text()
    assert "-m workers.engine" in plan_text and "-m torch.distributed.run" in plan_text


def test_an_engine_that_fails_to_start_is_shown_failed_with_its_log_tail(tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    # An engine that starts and fails before it serves: its thread count is not a number (the start-up checks
    # pass; a damaged model would not reach an engine any more, preflight refuses it: test_checkpoint_files).
    result = train("--hf-checkpoint", str(tiny_model_dir), "--prompt-data", "builtin:first_digit", "--rm-type",
                   "first_digit", "--rollout-num-engines", "1", "--debug-rollout-only", "--rollout-batch-size", "2",
                   "--num-rollout", "1", "--run-dir", str(tmp_path / "run"),
                   env={**os.environ, "RAYLESS_ENGINE_THREADS": "many"})
    assert result.returncode == 1, result.stderr[-3000:]
    err = result.stderr
    assert phases(err, "rollout-0")[0] == "starting" and phases(err, "rollout-0")[-1] == "failed", err
    assert "run failed: EngineLaunchError: engine rollout-0: exited with status" in err
    log_path = tmp_path / "run" / "logs" / "engine-rollout-0.log"
    assert f"--- last lines of {log_path} ---" in err and "RAYLESS_ENGINE_THREADS='many' is not an integer" in err
    assert "Traceback" not in err
