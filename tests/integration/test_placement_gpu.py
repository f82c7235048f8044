"""On a machine with a GPU: the node's GPUs as the plan counts them (without torch) agree with torch, and a
run launched from the plan puts our engine on CUDA on the GPU the plan gave it (issue 11 items 5 and 8).

Marked `gpu`; skipped where torch sees no CUDA device (CI has no GPU). With one GPU the run is
`--debug-rollout-only` (the engine alone on GPU 0: training beside it needs colocation); with two or more,
the whole loop: the rank on GPU 0, our engine on GPU 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coordinator.plan import detect_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (placement on real GPUs)"),
]


def test_the_plan_counts_the_gpus_torch_sees() -> None:
    environ = {key: value for key, value in os.environ.items() if key != "RAYLESS_PLAN_GPU_COUNT"}
    assert detect_gpus(environ).count == torch.cuda.device_count()


def test_a_run_puts_our_engine_on_the_gpu_the_plan_gave_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    two = torch.cuda.device_count() >= 2
    run_dir = tmp_path / "run"
    mode = ["--actor-num-gpus-per-node", "1"] if two else ["--debug-rollout-only"]
    env = {key: value for key, value in os.environ.items() if key != "RAYLESS_PLAN_GPU_COUNT"}
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "train", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data",
         "builtin:first_digit", "--rm-type", "first_digit", "--engine-backend", "rayless", "--rollout-num-gpus", "1",
         "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--num-rollout", "2",
         "--rollout-max-response-len", "4", "--no-progress", "--run-dir", str(run_dir), *mode],
        capture_output=True, text=True, timeout=600, check=False, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    plan = (run_dir / "plan.txt").read_text()
    engine_gpu = "1" if two else "0"
    assert f"CUDA_VISIBLE_DEVICES={engine_gpu}" in plan and "--device cuda --base-gpu-id 0" in plan
    engine_log = (run_dir / "logs" / "engine-rollout-0.log").read_text()
    assert "on cuda:0" in engine_log  # cuda:0 of the one GPU it sees
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rollouts"] == 2
    if two:
        assert "CUDA_VISIBLE_DEVICES=0 RAYLESS_CONTROL_ADDR" in plan and summary["train_steps"] == 2
