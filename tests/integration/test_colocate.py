"""Colocated runs on the CPU (issue 12): engines and ranks on "the same device" as the plan says, taking turns
each step — generate → engines release → ranks onload → train → ranks offload → engines take their weights
back → weight update → engines take their KV cache back.

One colocated job of the default task (12 rollouts as in tests/integration/test_train_e2e.py, with half its
samples, 16 prompts × 8, and lr 1e-2: the reward rises 5× there, 3.8× at test_train_e2e's size, for half the
CPU) whose reward at least doubles;
a run of a ~22 M-parameter model in which the engine's resident set during the train phase is lower by at least
80% of its weights' bytes; and fault tolerance during the swap: an engine killed while released is relaunched
with the current weights, a rank killed while offloaded is recovered by train FT. In every run, no request
reaches a released engine (the engines count them: 0).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from coordinator.services import Services
from tests.support.engine_proc import MID_MODEL_SPEC
from workers.tiny_model import build_tiny_model

COMMON = ["--prompt-data", "builtin:first_digit", "--rollout-max-response-len", "4", "--rollout-shuffle",
          "--lr", "3e-3", "--clip-grad", "1.0", "--no-progress", "--colocate"]
PHASES = ("generate", "release", "onload", "train", "export", "offload", "resume_weights", "update", "resume_kv")


def config_for(model: Path, run_dir: Path, *flags: str) -> Any:
    return parse_config(["--hf-checkpoint", str(model), "--run-dir", str(run_dir), *COMMON, *flags])


def check_swapped(rows: list[dict[str, Any]], *, engine_killed_at: int | None = None) -> None:
    """Every step went through every phase; the engines held no weights while the ranks trained; nothing was
    sent to a released engine. (At `engine_killed_at` the one engine was dead in the train phase: nothing held.)"""
    for row in rows:
        assert all(f"colocate/{phase}_s" in row for phase in PHASES), sorted(row)
        if row["step"] == engine_killed_at:
            assert "colocate/engine_weight_train_bytes" not in row
        else:
            assert row["colocate/engine_weight_train_bytes"] == 0
        assert row["colocate/engine_weight_generate_bytes"] > 0
        assert row["colocate/engine_requests_refused_while_released"] == 0
        assert 0 < row["colocate/swap_share"] < 1
        assert row["colocate/swap_s"] == pytest.approx(sum(row[f"colocate/{p}_s"] for p in
                                                           ("release", "onload", "export", "offload",
                                                            "resume_weights", "resume_kv")))


@pytest.fixture(scope="module")
def colocated_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    run_dir = tmp_path_factory.mktemp("colocated")
    config = config_for(tiny_model_dir, run_dir, "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
                        "--lr", "1e-2", "--actor-num-gpus-per-node", "2", "--rollout-num-engines", "2",
                        "--num-rollout", "12")
    summary = anyio.run(run_training, config)
    return run_dir, summary


def test_a_colocated_run_learns_as_the_default_job_does(colocated_run: tuple[Path, dict[str, Any]]) -> None:
    run_dir, summary = colocated_run
    assert summary["train_steps"] == 12 and summary["final_weight_version"] == "12"
    rows = read_metrics(run_dir / "metrics.jsonl")
    rewards = [row["rollout/reward_mean"] for row in rows]
    assert sum(rewards[-3:]) / 3 >= 2 * sum(rewards[:3]) / 3, rewards
    assert max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows) <= 1e-4  # synced exactly
    assert [row["weight_version"] for row in rows] == [str(i + 1) for i in range(12)]
    check_swapped(rows)


def test_the_colocated_plan_and_its_tmpfs_snapshots(colocated_run: tuple[Path, dict[str, Any]]) -> None:
    run_dir, _ = colocated_run
    plan = (run_dir / "plan.txt").read_text()
    assert "placement plan (policy colocate" in plan and "memory hand-over each step" in plan
    assert "--weight-spill-dir" in plan  # released CPU weights go to disk, not to memory elsewhere
    if Path("/dev/shm").is_dir():
        directory = Path(plan.split("rank 0 writes a safetensors snapshot under ")[1].split(" (")[0])
        assert str(directory).startswith("/dev/shm/rayless-") and "tmpfs" in plan
        assert not directory.parent.exists()  # the run's snapshots in RAM are removed when it ends
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["colocation_settled_s"] > 0 and summary["colocation_engine_deaths"] == []


def test_the_engines_resident_set_drops_by_their_weights_while_the_ranks_train(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "mid-model", MID_MODEL_SPEC)  # ~22 M parameters, 84 MiB float32
    config = config_for(model, tmp_path / "run", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                        "--actor-num-gpus-per-node", "1", "--rollout-num-engines", "1", "--num-rollout", "2")
    summary = anyio.run(run_training, config)
    assert summary["train_steps"] == 2
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    check_swapped(rows)
    for row in rows:
        weights = row["colocate/engine_weight_generate_bytes"]
        assert weights > 80e6
        drop = row["colocate/engine_rss_generate_bytes"] - row["colocate/engine_rss_train_bytes"]
        assert drop >= 0.8 * weights, f"the engine's RSS fell {drop / 2**20:.0f} MiB of {weights / 2**20:.0f} MiB"
        # the rank's state came back for the step (and left again): its RSS is lower once offloaded
        assert row["colocate/rank_offload_rss_bytes"] < row["colocate/rank_offload_before_rss_bytes"]


class SwapKiller:
    """Kills rank 0 right after the step of `rank_at` (its state is offloaded then: the engines generate) and
    the rollout engine while it is released, in the train phase of rollout `engine_at`."""

    def __init__(self, services: Services, *, rank_at: int, engine_at: int) -> None:
        self.services = services
        self.rank_at = rank_at
        self.engine_at = engine_at
        self.rollout = 0
        self.killed: list[str] = []
        assert services.colocation is not None
        services.colocation.observers.append(self.on_phase)

    def on_phase(self, phase: str) -> None:
        if phase == "train" and self.rollout == self.engine_at and "engine" not in self.killed:
            engine = self.services.fleet.engines[0]
            assert engine.process is not None and engine.process.pid is not None
            os.killpg(engine.process.pid, signal.SIGKILL)
            self.killed.append("engine")

    async def after_step(self, rollout_id: int, weight_version: str) -> None:
        self.rollout = rollout_id + 1
        if rollout_id == self.rank_at:
            os.kill(self.services.train_group.ranks[0].pid, signal.SIGKILL)
            self.killed.append("rank")


async def test_an_engine_dead_while_released_and_a_rank_dead_while_offloaded_are_recovered(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = config_for(tiny_model_dir, tmp_path / "run", "--rollout-batch-size", "4", "--n-samples-per-prompt",
                        "2", "--actor-num-gpus-per-node", "1", "--rollout-num-engines", "1", "--num-rollout", "4",
                        "--use-fault-tolerance", "--ft-components", "rollout,train", "--max-restarts", "1",
                        "--save", str(tmp_path / "ckpt"), "--save-interval", "1")
    killers: list[SwapKiller] = []

    def hooks(services: Services) -> list[Any]:
        killers.append(SwapKiller(services, rank_at=0, engine_at=2))
        return killers

    summary = await run_training(config, extra_hooks=hooks)
    assert killers[0].killed == ["rank", "engine"]
    assert summary["train_steps"] == 4 and summary["final_weight_version"] == "4"
    assert summary["train_recoveries"] == 1  # the rank: restarted, the last checkpoint loaded, onloaded again
    assert summary["colocation_engine_deaths"] == ["rollout-0"]
    # the engine was relaunched once, by the weight update's recovery, from the snapshot of the weights just
    # trained (the health monitor, paused during the swap, saw it come back)
    assert summary["ft"]["weight_sync_recoveries"] == 1 and killers[0].services.fleet.engines[0].incarnation == 2
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [row["weight_version"] for row in rows] == ["1", "2", "3", "4"]
    check_swapped(rows, engine_killed_at=2)
