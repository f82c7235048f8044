"""A user's hooks against a real `rayless train` (CPU engine, torchrun, one gloo rank), in one run:

- a generate function raising its own CancelledError, then KeyboardInterrupt, fails those episodes only: the
  samples are generated again and the first step trains (no sample without tokens reaches the rank);
- a reward function raising SystemExit fails its sample only (FAILED, reward 0.0, `rollout/failed_samples` 1);
- SIGINT while the reward function is blocked in time.sleep(600) stops the run within the stop's bound (the
  same as tests/integration/test_signals.py), exit 130, with a line naming the hook, every process gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.support.processes import STOP_BOUND_S, wait_gone
from tests.support.waiting import wait_until_sync

#: The stop's bound (tests/support/processes.py, as tests/integration/test_signals.py): no process of the run left
#: after it; the blocked hook would hold the run for 600 s.
GONE_WITHIN_S = STOP_BOUND_S
DATA = Path(__file__).resolve().parents[1] / "data"


def test_hook_escapes_fail_their_episode_and_sigint_does_not_wait_for_a_blocked_hook(tiny_model_dir: Path,
                                                                                      tmp_path: Path) -> None:
    run_dir, blocked, stderr = tmp_path / "run", tmp_path / "blocked", tmp_path / "stderr"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DATA), os.environ.get("PYTHONPATH", "")]),
           "HOOK_RUN_DIR": str(run_dir), "HOOK_BLOCKED": str(blocked)}
    command = [sys.executable, "-m", "coordinator.cli", "train", "--hf-checkpoint", str(tiny_model_dir),
               "--prompt-data", "builtin:first_digit", "--custom-generate-function-path", "hook_escapes.generate",
               "--custom-rm-path", "hook_escapes.reward", "--rollout-num-engines", "1",
               "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
               "--num-rollout", "100", "--rollout-max-response-len", "4", "--run-dir", str(run_dir), "--no-progress"]
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
    processes: list[psutil.Process] = []
    try:
        def is_blocked() -> bool:
            assert proc.poll() is None, f"the run ended ({proc.returncode}):\n{stderr.read_text()[-3000:]}"
            return blocked.exists()

        wait_until_sync(is_blocked, timeout=240, interval=0.2, what="the reward hook blocked in rollout 1")
        processes = psutil.Process(proc.pid).children(recursive=True)
        assert any("workers.train_rank" in " ".join(p.cmdline()) for p in processes)
        signalled = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=GONE_WITHIN_S)
        left = wait_gone(processes, timeout=signalled + GONE_WITHIN_S - time.monotonic())
        assert not left, [p.cmdline() for p in left]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for process in processes:
            if process.is_running():
                process.kill()
    err = stderr.read_text()
    assert code == 130, err[-3000:]
    assert "--custom-rm-path 'hook_escapes.reward' was still running after" in err, err[-3000:]
    assert "SIGINT received" in err and "Traceback" not in err, err[-3000:]
    assert "hook_escapes.generate' raised CancelledError()" in err and "raised KeyboardInterrupt()" in err
    assert "hook_escapes.reward' raised SystemExit(4)" in err
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["rollout/failed_samples"] == 1.0, first
    assert first["rollout/aborted_stragglers"] >= 2  # the two failed episodes, generated again
    ranks_log = (run_dir / "train_ranks.log").read_text()
    assert "BatchError" not in ranks_log and "Traceback" not in ranks_log, ranks_log[-3000:]
