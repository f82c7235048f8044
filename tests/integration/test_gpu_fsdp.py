"""On a machine with a GPU: one train step with FSDP2 on CUDA matches the CPU (gloo) step on the same data.

Marked `gpu`; where torch sees no CUDA device the test is reported as skipped with that reason (CI has no
GPU). Run it on a GPU machine with `./run.sh test -m gpu`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from coordinator.train.group import TrainGroup
from coordinator.train.torchrun import TorchrunSpec
from tests.support.train_samples import TRAIN_CONFIG, as_samples, synthetic_samples
from tests.support.train_settings import flat_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FSDP2 path)"),
]


async def one_step(model_dir: Path, run_dir: Path, samples: list[Any], *, cuda: bool, compute_dtype: str | None):
    env = {} if cuda else {"CUDA_VISIBLE_DEVICES": ""}
    config = {**TRAIN_CONFIG, "model_path": str(model_dir), "global_batch_size": len(samples),
              "use_kl_loss": False, "kl_loss_coef": 0.0, "warmup_steps": 0}
    if compute_dtype:
        config["compute_dtype"] = compute_dtype
    async with anyio.create_task_group() as tg:
        group: TrainGroup = await tg.start(TrainGroup(TorchrunSpec(nproc_per_node=1), run_dir=run_dir, extra_env=env).run)
        info = await group.commands.init(flat_settings(config))
        metrics = await group.commands.train(0, samples)
        await group.shutdown()
        tg.cancel_scope.cancel()
    return info, metrics


async def test_fsdp2_step_on_cuda_matches_the_cpu_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    samples = as_samples(synthetic_samples(tiny_model_dir, 8, seed=3))
    cpu_info, cpu = await one_step(tiny_model_dir, tmp_path / "cpu", samples, cuda=False, compute_dtype=None)
    gpu_info, gpu = await one_step(tiny_model_dir, tmp_path / "gpu", samples, cuda=True, compute_dtype="bfloat16")
    assert cpu_info.device == "cpu" and gpu_info.device.startswith("cuda")
    # bf16 compute: ~3 significant digits
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=2e-2, abs=2e-3)
    assert gpu["entropy"] == pytest.approx(cpu["entropy"], rel=2e-2)
    assert gpu["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=5e-2)
