"""Start-up validation through the real CLI, as a subprocess: exit 2, the flags named, nothing launched (no
child process, neither the launcher nor torch imported)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# The same base flags as tests/unit/test_config.py ("/model" is replaced where a test needs a real directory).
BASE = ["--hf-checkpoint", "/model", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--num-rollout", "3", "--prompt-data", "builtin:first_digit"]


PROBE = textwrap.dedent(
    """
    import json, sys, psutil
    from coordinator.cli import main
    status = main(sys.argv[1:])
    print(json.dumps({
        "status": status,
        "children": len(psutil.Process().children(recursive=True)),
        "launcher_imported": "coordinator.run" in sys.modules,
        "torch_imported": "torch" in sys.modules,
    }))
    """
)


def run_cli(*args: str) -> tuple[dict, str]:
    result = subprocess.run([sys.executable, "-c", PROBE, "train", *args], capture_output=True, text=True,
                            timeout=60, check=False)
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--rollout-num-engines", "1", "--load-debug-rollout-data", "d/{rollout_id}", "--debug-rollout-only"],
         ["--load-debug-rollout-data", "--debug-rollout-only"]),
        (["--load-debug-rollout-data", "d/{rollout_id}", "--eval-num-engines", "1"],
         ["--load-debug-rollout-data", "--eval-num-engines"]),
        (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
         ["--rollout-num-gpus", "--rollout-num-gpus-per-engine"]),
        (["--rollout-num-engines", "1", "--use-fault-tolerance", "--ft-components", "rollout,trian"],
         ["--ft-components", "trian"]),
        ([], ["--rollout-num-engines", "--rollout-external-engine-addrs", "--debug-train-only"]),
        (["--load-debug-rollout-data", "dumps/rollout.rld"], ["--load-debug-rollout-data", "{rollout_id}"]),
        (["--rollout-num-engines", "1", "--rollout-batch-size", "0"], ["--rollout-batch-size"]),
        (["--rollout-num-engines", "1", "--n-samples-per-prompt", "-1"], ["--n-samples-per-prompt"]),
        (["--rollout-num-engines", "1", "--global-batch-size", "3"],
         ["--global-batch-size", "--rollout-batch-size", "--n-samples-per-prompt"]),
        (["--rollout-num-engines", "1", "--debug-train-only", "--debug-rollout-only"],
         ["--debug-train-only", "--debug-rollout-only"]),
    ],
    ids=["replay+rollout-only", "replay+eval-fleet", "gpus-not-divisible", "unknown-ft-component",
         "no-engines", "template-without-rollout-id", "zero-batch", "negative-n-samples",
         "global-batch-not-dividing", "train-only+rollout-only"],
)
def test_contradictory_flags_exit_2_naming_flags_before_launching(flags: list[str], named: list[str]) -> None:
    outcome, stderr = run_cli(*BASE, *flags)
    assert outcome["status"] == 2, stderr
    for flag in named:
        assert flag in stderr, (flag, stderr)
    assert outcome["children"] == 0
    assert not outcome["launcher_imported"] and not outcome["torch_imported"]


def test_missing_model_directory_is_reported_before_launching(tmp_path: Path) -> None:
    outcome, stderr = run_cli(*[a if a != "/model" else str(tmp_path / "nope") for a in BASE],
                              "--rollout-num-engines", "1")
    assert outcome["status"] == 2 and "--hf-checkpoint" in stderr and "make-tiny-model" in stderr
    assert outcome["children"] == 0 and not outcome["launcher_imported"]


def test_asking_for_a_metrics_backend_that_is_not_installed_fails_before_launching(tiny_model_dir: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here, so --use-wandb is valid")  # CI installs no wandb
    args = [a if a != "/model" else str(tiny_model_dir) for a in BASE]
    outcome, stderr = run_cli(*args, "--rollout-num-engines", "1", "--use-wandb")
    assert outcome["status"] == 2 and "--use-wandb" in stderr and "pip install wandb" in stderr
    assert outcome["children"] == 0 and not outcome["launcher_imported"]
