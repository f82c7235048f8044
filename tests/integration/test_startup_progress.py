"""What a person sees while a run starts, in plain lines (`--no-progress`, or no terminal): every launched
process's phases in order, the run-level ETA beside each rollout's line (`assert_a_start_shown_in_order`, checked
on the CLI run `test_signals` starts anyway, rather than on a run of its own), and the log tail of a process that
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


def assert_a_start_shown_in_order(err: str, run_dir: Path, *, rollouts: int) -> None:
    """A CPU run's stderr (one engine, one rank): every launched process's phases in order, the plan first, then
    each rollout's line named by its id from 0 (as metrics.jsonl and checkpoints name it), the count done and
    the run's elapsed and ETA. Checked on a run another test starts anyway (`test_signals`' SIGTERM run)."""
    assert phases(err, "rollout-0") == ["starting", "loading", "healthy"], err
    assert phases(err, "train-ranks") == ["starting", "connected 1/1", "loading", "ready"], err
    assert "start-up: rollout-0 [CPU · port " in err and "start-up: train-ranks [CPU · 1 rank(s)]" in err
    assert err.index("placement plan") < err.index("start-up: rollout-0") < err.index(f"rollout 0 (1 of {rollouts})")
    rollout_lines = [line for line in err.splitlines() if re.search(rf"rollout \d+ \(\d+ of {rollouts}\) ", line)]
    named = [re.search(r"rollout (\d+) \((\d+) of", line).groups() for line in rollout_lines]  # type: ignore[union-attr]
    assert named and named == [(str(i), str(i + 1)) for i in range(len(named))], err
    assert all(re.search(r"elapsed \d+:\d\d:\d\d  ETA \d+:\d\d:\d\d$", line) for line in rollout_lines), rollout_lines
    plan_text = (run_dir / "plan.txt").read_text()
    assert "-m workers.engine" in plan_text and "-m torch.distributed.run" in plan_text
    # torchrun's per-launch directories go in the run directory, not one `torchelastic_*` left in /tmp per launch
    assert f"--log-dir {run_dir / 'torchrun'}" in plan_text
    assert list((run_dir / "torchrun").glob("*/attempt_0")), sorted((run_dir / "torchrun").rglob("*"))


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
