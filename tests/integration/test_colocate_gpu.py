"""On a machine with a GPU (issue 12 on CUDA): a CUDA rank's state leaves the GPU and comes back bit-identical,
the memory going back to the driver; bringing it back refuses politely when the GPU has no room beyond
`--train-memory-margin-bytes`; and the default job runs colocated on GPU 0 — our engine on CUDA and one FSDP2
rank sharing it — with the engine holding no weights while the rank trains.

Marked `gpu`; skipped where torch sees no CUDA device (CI has no GPU). `bench/gpu_check.sh` runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

from coordinator.observe.progress import read_metrics
from coordinator.train.errors import RankCommandError
from coordinator.train.group import TrainGroup
from coordinator.train.torchrun import TorchrunSpec
from tests.support.engine_proc import MID_MODEL_SPEC
from tests.support.train_samples import TRAIN_CONFIG, as_samples, synthetic_samples
from tests.support.train_settings import flat_settings
from workers.tiny_model import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (colocation on a GPU)"),
]


async def test_a_cuda_rank_offloads_to_host_memory_and_onloads_bit_identical(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "mid-model", MID_MODEL_SPEC)  # ~22 M parameters: a visible drop
    samples = as_samples(synthetic_samples(model, 8, seed=5))
    config = {**TRAIN_CONFIG, "model_path": str(model), "global_batch_size": len(samples), "use_kl_loss": False,
              "kl_loss_coef": 0.0, "warmup_steps": 0, "compute_dtype": "bfloat16"}
    async with anyio.create_task_group() as tg:
        group: TrainGroup = await tg.start(TrainGroup(TorchrunSpec(nproc_per_node=1), run_dir=tmp_path / "run").run)
        await group.commands.init(flat_settings(config))
        await group.commands.train(0, samples)  # gradients and optimizer state exist from here on
        out = await group.commands.offload(verify=True)
        print("offload", out.seconds, out.figures())
        freed = out.memory["before_cuda_allocated_bytes"] - out.memory["cuda_allocated_bytes"]
        assert out.state_bytes > 4 * 80e6  # parameters, gradients and two Adam moments, float32
        assert freed >= 0.8 * out.state_bytes, (freed, out.state_bytes)
        assert out.memory["cuda_reserved_bytes"] <= out.memory["cuda_allocated_bytes"] + 64 * 2**20  # back to the driver
        back = await group.commands.onload(verify=True)
        print("onload", back.seconds, back.figures())
        assert back.digests == out.digests and all(out.digests)
        assert back.memory["cuda_allocated_bytes"] >= out.state_bytes
        assert torch.isfinite(torch.tensor((await group.commands.train(1, samples))["loss"]))

        await group.commands.init(flat_settings({**config, "train_memory_margin_bytes": 10**15}))  # more than any GPU has
        await group.commands.offload()
        with pytest.raises(RankCommandError, match="--train-memory-margin-bytes"):
            await group.commands.onload()
        await group.shutdown()
        tg.cancel_scope.cancel()


def test_the_default_job_runs_colocated_on_one_gpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {key: value for key, value in os.environ.items() if key != "RAYLESS_PLAN_GPU_COUNT"}
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "train", "--hf-checkpoint", str(tiny_model_dir), "--prompt-data",
         "builtin:first_digit", "--rm-type", "first_digit", "--engine-backend", "rayless", "--colocate",
         "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
         "--num-rollout", "3", "--rollout-max-response-len", "4", "--no-progress", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=600, check=False, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    plan = (run_dir / "plan.txt").read_text()
    assert "policy colocate" in plan and "train-ranks  0 shared" in plan and "rollout-0    0 shared" in plan
    assert "--device cuda --base-gpu-id 0" in plan
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["train_steps"] == 3 and summary["final_weight_version"] == "3"
    for row in read_metrics(run_dir / "metrics.jsonl"):
        assert row["colocate/engine_weight_train_bytes"] == 0
        assert row["colocate/engine_cuda_allocated_train_bytes"] < row["colocate/engine_cuda_allocated_generate_bytes"]
        # the rank's whole state leaves the GPU and comes back; what stays (64 MiB on the H200: the cuBLAS
        # workspace, allocated at the first matmul) does not move, so compare the change with the state's bytes
        state = row["colocate/rank_offload_state_bytes"]
        assert state > 0
        freed = row["colocate/rank_offload_before_cuda_allocated_bytes"] - row["colocate/rank_offload_cuda_allocated_bytes"]
        brought = row["colocate/rank_onload_cuda_allocated_bytes"] - row["colocate/rank_onload_before_cuda_allocated_bytes"]
        onloaded = row["colocate/rank_onload_state_bytes"]  # before the first step: no optimizer state yet
        assert freed >= 0.9 * state and brought >= 0.9 * onloaded, (freed, brought, state, onloaded)
        assert row["colocate/engine_requests_refused_while_released"] == 0
        # the weights moved through the tmpfs snapshot: both sides float32 on the GPU, only summation order differs
        assert row["train/train_rollout_logprob_abs_diff_max"] < 1e-2
