"""A vision-language run end to end: the built-in `colour` task (images drawn at start-up) on the tiny VLM,
one CPU engine serving `image_data`, one gloo rank training the packed rows with their images.

It shows what the text task's run shows (tests/integration/test_train_e2e.py), by the same margins: the reward
rises (the last three rollouts' mean at least twice the first three's) and, after every weight sync, the
trainer's logprobs of each sampled token equal the engine's (which they could not if either side dropped the
images or their multimodal positions). Kept short: CI has 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training

ROLLOUTS = 8


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from workers.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))
    run_dir = tmp_path_factory.mktemp("vlm-run")
    config = parse_config(["--hf-checkpoint", str(model), "--run-dir", str(run_dir), "--prompt-data",
                           "builtin:colour", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
                           "--rollout-max-response-len", "4", "--rollout-shuffle", "--lr", "1e-2", "--clip-grad",
                           "1.0", "--rollout-num-engines", "1", "--num-rollout", str(ROLLOUTS), "--no-progress"])
    summary = anyio.run(run_training, config)
    assert summary["rollouts"] == ROLLOUTS and summary["train_steps"] == ROLLOUTS
    return run_dir


def test_the_colour_task_learns_and_the_trainer_matches_the_engine_with_images(vlm_run: Path) -> None:
    rows = read_metrics(vlm_run / "metrics.jsonl")
    rewards = [row["rollout/reward_mean"] for row in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= 2 * first, rewards
    assert [row["weight_version"] for row in rows] == [str(i + 1) for i in range(ROLLOUTS)]
    worst = max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows)
    assert worst <= 1e-4, worst  # rollouts 1.. ran on weights the rank synced to the engine by disk
    engine_log = (vlm_run / "logs" / "engine-rollout-0.log").read_text()
    assert "Traceback" not in engine_log
