"""`--true-on-policy-mode` through whole runs: our CPU engine over HTTP and two torchrun/gloo ranks.

One run pair, run side by side, feeds both checks: the trainer's logprobs of the sampled tokens equal the
engine's exactly (the recorded train/rollout difference is 0.0, not small), and the second run, with the same
seeds, writes the same metrics (wall-clock fields aside). Runs are kept short: CI has 2 cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training

pytestmark = pytest.mark.slow  # two whole runs, each an engine and two ranks

ROLLOUTS = 2
FLAGS = ["--prompt-data", "builtin:first_digit", "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
         "--rollout-max-response-len", "4", "--rollout-seed", "7", "--rollout-shuffle", "--lr", "3e-3", "--num-rollout", str(ROLLOUTS),
         "--rollout-num-engines", "1", "--actor-num-gpus-per-node", "2", "--no-progress", "--true-on-policy-mode"]


def wall_clock(key: str) -> bool:
    """Fields that measure time (durations, rates, timestamps): the only ones two runs may disagree on."""
    words = key.replace("/", "_").split("_")
    return bool({"time", "s", "ms", "seconds", "timestamp", "throughput", "latency", "wall"} & set(words)) \
        or key.endswith("per_s") or "time" in key


async def both_runs(model: Path, run_dirs: list[Path]) -> list[dict[str, Any]]:
    """The two runs at the same time: each under the load of the other, so their timings differ."""
    summaries: list[dict[str, Any]] = [{}, {}]

    async def one(index: int) -> None:
        config = parse_config(["--hf-checkpoint", str(model), "--run-dir", str(run_dirs[index]), *FLAGS])
        summaries[index] = await run_training(config)

    async with anyio.create_task_group() as group:
        for index in range(2):
            group.start_soon(one, index)
    return summaries


@pytest.fixture(scope="module")
def run_pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    run_dirs = [tmp_path_factory.mktemp(name) for name in ("first", "second")]
    summaries = anyio.run(both_runs, tiny_model_dir, run_dirs)
    assert [summary["train_steps"] for summary in summaries] == [ROLLOUTS, ROLLOUTS]
    return [read_metrics(run_dir / "metrics.jsonl") for run_dir in run_dirs]


def test_trainer_logprobs_equal_the_engines_exactly(run_pair: list[list[dict[str, Any]]]) -> None:
    for rows in run_pair:
        assert len(rows) == ROLLOUTS
        assert [row["train/train_rollout_logprob_abs_diff_max"] for row in rows] == [0.0] * ROLLOUTS
        assert [row["train/train_rollout_logprob_abs_diff_mean"] for row in rows] == [0.0] * ROLLOUTS


def test_two_runs_with_the_same_seed_write_the_same_metrics(run_pair: list[list[dict[str, Any]]]) -> None:
    first, second = run_pair
    timing = {key for row in first + second for key in row if wall_clock(key)}
    assert timing, "no wall-clock field recognised: the filter below would compare nothing away"
    strip = [[{k: v for k, v in row.items() if k not in timing} for row in rows] for rows in run_pair]
    assert strip[0] == strip[1]
    assert len(strip[0][0]) > 10  # losses, rewards, logprob gaps, grad norms: the comparison is not empty
    # the runs trained: the policy moved, so equal metrics are not equal because nothing happened
    assert any(row["train/grad_norm"] > 0 for row in first[:-1])
