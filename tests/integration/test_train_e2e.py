"""Whole runs: generate → train → sync on real CPU engines and torchrun ranks; replay; resume.

One generating run (module fixture) feeds several checks: the reward rises, training logprobs match the
engines', dumps replay with no engine process and, given no training flag, repeat the generating run's losses,
and a resumed run (a second module fixture, its weights synced by distributed sync) continues with the same data
order and losses and serves engines the exact weights. A PPO run with a critic (a third fixture, one engine)
learns by the same margin while its value loss falls, and resumes exactly, critic included. Runs are kept
short: CI has 2 cores.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from coordinator.config import parse_config
from coordinator.observe.progress import read_metrics
from coordinator.run import run_training
from replay.format import dump_path
from replay.reader import read_dump

ROLLOUTS = 12
COMMON = ["--prompt-data", "builtin:first_digit", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
          "--rollout-max-response-len", "4", "--rollout-shuffle", "--lr", "3e-3", "--clip-grad", "1.0",
          "--actor-num-gpus-per-node", "2", "--no-progress"]


def config_for(model: Path, run_dir: Path, *flags: str):
    return parse_config(["--hf-checkpoint", str(model), "--run-dir", str(run_dir), *COMMON, *flags])


class ChildWatch:
    """Records the command lines of every child process seen while a run goes on."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    async def run(self) -> None:
        while True:
            for child in psutil.Process().children(recursive=True):
                try:
                    self.seen.add(" ".join(child.cmdline()))
                except psutil.Error:
                    pass
            await anyio.sleep(0.2)


async def run_watched(config: Any) -> tuple[dict[str, Any], set[str]]:
    watch = ChildWatch()
    async with anyio.create_task_group() as group:
        group.start_soon(watch.run)
        summary = await run_training(config)
        group.cancel_scope.cancel()
    return summary, watch.seen


@pytest.fixture(scope="module")
def generated_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("generated")
    config = config_for(tiny_model_dir, run_dir, "--rollout-num-engines", "2", "--num-rollout", str(ROLLOUTS),
                        "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld"),
                        "--save", str(run_dir / "ckpt"), "--save-interval", "6",
                        "--save-hf", str(run_dir / "hf" / "{rollout_id}"))
    said = logging.FileHandler(run_dir / "said.log")  # what the run told its user (the CLI's coordinator.log)
    logger = logging.getLogger("rayless")
    level = logger.level
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    try:
        summary, children = anyio.run(run_watched, config)
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
        said.close()
    (run_dir / "children.json").write_text(json.dumps(sorted(children)))
    assert summary["rollouts"] == ROLLOUTS and summary["train_steps"] == ROLLOUTS
    return run_dir


def test_the_ranks_end_on_their_shutdown_command(generated_run: Path) -> None:
    """Told to shut down, every rank returns and torchrun exits 0: no rank failure in the ranks' log."""
    ranks_log = (generated_run / "train_ranks.log").read_text()
    assert "-m workers.train_rank" in ranks_log.splitlines()[0]
    assert "ChildFailedError" not in ranks_log and "Traceback" not in ranks_log, ranks_log[-3000:]


def test_each_save_is_reported_where_the_checkpoint_lies(generated_run: Path) -> None:
    """A periodic save is written to `tmp-<id>` and published once its metrics row is: the line a person reads
    names the published `rollout_<id>`, which a resume's `--load` takes, never the temporary directory."""
    said = [line for line in (generated_run / "said.log").read_text().splitlines()
            if line.startswith("saved checkpoint of rollout")]
    save = generated_run / "ckpt"
    assert said == [f"saved checkpoint of rollout {r} to {save / f'rollout_{r}'}" for r in (5, 11)], said
    assert (save / "rollout_5").is_dir() and (save / "rollout_11").is_dir()
    assert not list(save.glob("tmp-*"))
    # the run's last line says where its model is: the last --save-hf directory, which transformers loads
    last = (generated_run / "said.log").read_text().splitlines()[-1]
    assert last.startswith(f"the model of rollout 11: {generated_run / 'hf' / '11'} ("), last


def losses(run_dir: Path) -> list[float]:
    return [row["train/loss"] for row in read_metrics(run_dir / "metrics.jsonl")]


def test_the_reward_rises_and_engines_serve_every_new_version(generated_run: Path) -> None:
    rows = read_metrics(generated_run / "metrics.jsonl")
    rewards = [row["rollout/reward_mean"] for row in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= 2 * first, rewards
    assert [row["weight_version"] for row in rows] == [str(i + 1) for i in range(ROLLOUTS)]
    assert (generated_run / "rewards.png").stat().st_size > 0
    children = json.loads((generated_run / "children.json").read_text())
    assert sum("workers.engine" in c for c in children) >= 2 and any("workers.train_rank" in c for c in children)


def test_training_logprobs_match_the_engines_by_disk_sync(generated_run: Path) -> None:
    rows = read_metrics(generated_run / "metrics.jsonl")
    worst = max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows)
    assert worst <= 1e-4, worst  # every rollout after the first ran on weights pushed by disk sync


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # rayless export's dcp.load
def test_save_hf_is_the_trained_and_the_served_model_and_export_gives_the_same(generated_run: Path,
                                                                               tmp_path: Path) -> None:
    """--save-hf at each save (rollouts 5 and 11): a directory transformers loads and generates from (its
    manifest listing every file with a digest that holds), holding the trainer's weights of that step (its
    checkpoint, by `rayless export`) and what the engines served at that version (their disk snapshot
    weights-12, kept as one of the newest two)."""
    from coordinator.cli import main as rayless
    from tests.support.hf_dirs import file_weights, loads_and_generates, max_difference
    from workers.boundary.manifest import check_manifest

    assert sorted(path.name for path in (generated_run / "hf").iterdir()) == ["11", "5"]
    for rollout_id in (5, 11):
        saved = generated_run / "hf" / str(rollout_id)
        assert "model.safetensors" in check_manifest(saved)  # the rank's manifest: every file, digests that hold
        assert rayless(["export", str(generated_run / "ckpt" / f"rollout_{rollout_id}"),
                        str(tmp_path / str(rollout_id))]) == 0
        weights = file_weights(saved)
        assert max_difference(file_weights(tmp_path / str(rollout_id)), weights) <= 1e-6
        for directory in (saved, tmp_path / str(rollout_id)):
            loaded = loads_and_generates(directory)
            assert max_difference({name: loaded[name] for name in weights}, weights) <= 1e-6
    served = generated_run / "weights" / "weights-12"  # the version the engines served after step 11
    assert (served / "rayless_weight_version.txt").read_text().strip() == "12"
    assert max_difference(file_weights(generated_run / "hf" / "11"), file_weights(served)) <= 1e-6
    assert max_difference(file_weights(generated_run / "hf" / "5"), file_weights(served)) > 1e-3  # trained on


async def test_replay_trains_with_no_engine_and_repeats_the_generating_runs_losses(generated_run: Path,
                                                                                  tiny_model_dir: Path,
                                                                                  tmp_path: Path,
                                                                                  caplog: pytest.LogCaptureFixture
                                                                                  ) -> None:
    template = str(generated_run / "dumps" / "{rollout_id}.rld")
    run_dir = tmp_path / "replay"
    # No training flag and no model: the dumps recorded the generating run's (its --lr 3e-3, not the default 1e-6)
    config = parse_config(["--run-dir", str(run_dir), "--load-debug-rollout-data", template, "--num-rollout", "2",
                           "--actor-num-gpus-per-node", "2", "--no-progress"])
    assert config.train.lr == 3e-3 and config.rollout.hf_checkpoint == str(tiny_model_dir)
    with caplog.at_level(logging.INFO, logger="rayless"):
        summary, children = await run_watched(config)
    assert summary["train_steps"] == 2
    steps = [r.getMessage() for r in caplog.records if r.name == "rayless" and "loss " in r.getMessage()]
    assert len(steps) == 2 and not [line for line in steps if " gen " in line], steps  # nothing was generated
    assert not [c for c in children if "workers.engine" in c or "sglang" in c], children
    assert any("workers.train_rank" in c for c in children)
    # The replayed batches are the generated ones and the replay starts from the same weights, so a second set of
    # processes computes every step's loss again: the first step's as the generating run had it, and the second's
    # after an optimizer step taken again on the same data (training is deterministic, not just the data).
    replayed, generated = losses(run_dir), losses(generated_run)[:2]
    assert replayed == pytest.approx(generated, abs=1e-6), (replayed, generated)


@pytest.fixture(scope="module")
def resumed_run(generated_run: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generating run resumed from its rollout-5 checkpoint, its weights pushed by distributed sync (the
    generating run pushed them by disk): one run shows both the resume and the distributed sync."""
    checkpoint = generated_run / "ckpt" / "rollout_5"
    assert checkpoint.is_dir(), sorted(p.name for p in (generated_run / "ckpt").iterdir())
    run_dir = tmp_path_factory.mktemp("resumed")
    # the same run directory as the run that crashed: its metrics.jsonl holds steps 0..11 already
    shutil.copy(generated_run / "metrics.jsonl", run_dir / "metrics.jsonl")
    config = config_for(tiny_model_dir, run_dir, "--rollout-num-engines", "2", "--num-rollout", "8",
                        "--load", str(checkpoint), "--update-weight-transfer-mode", "distributed",
                        "--save-debug-rollout-data", str(run_dir / "dumps" / "{rollout_id}.rld"))
    summary = anyio.run(run_training, config)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_resume_continues_with_the_same_data_order_and_losses(generated_run: Path, resumed_run: Path) -> None:
    summary = json.loads((resumed_run / "summary.json").read_text())
    assert summary["rollouts"] == 2  # rollouts 6 and 7
    rows = read_metrics(resumed_run / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(8)), "each step once: the resumed ones replaced"
    for rollout_id in (6, 7):
        original = read_dump(dump_path(str(generated_run / "dumps" / "{rollout_id}.rld"), rollout_id)).samples
        resumed = read_dump(dump_path(str(resumed_run / "dumps" / "{rollout_id}.rld"), rollout_id)).samples
        assert [s.metadata["prompt_index"] for s in resumed] == [s.metadata["prompt_index"] for s in original]
        assert [s.tokens for s in resumed] == [s.tokens for s in original]
    assert losses(resumed_run)[6:] == pytest.approx(losses(generated_run)[6:8], abs=1e-6)


def test_distributed_sync_gives_engines_the_exact_weights(resumed_run: Path) -> None:
    summary = json.loads((resumed_run / "summary.json").read_text())
    assert summary["train_steps"] == 2 and summary["final_weight_version"] == "8"
    # rollout 6 ran on the checkpoint's weights, rollout 7 on step 6's: both pushed by distributed sync
    rows = read_metrics(resumed_run / "metrics.jsonl")[6:]
    assert max(row["train/train_rollout_logprob_abs_diff_max"] for row in rows) <= 1e-4
    assert all(row["sync/engines"] == 2 for row in rows)


PPO_FLAGS = ("--advantage-estimator", "ppo", "--normalize-advantages", "--num-critic-only-steps", "2",
             "--custom-rm-path", "tests.support.rollout_fns:offset_first_digit_reward", "--rollout-num-engines", "1")


@pytest.fixture(scope="module")
def ppo_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PPO with a critic on the tiny task, its reward the task's score + 1 (a level the fresh critic, predicting
    0, must learn); a checkpoint at rollout 5."""
    run_dir = tmp_path_factory.mktemp("ppo")
    config = config_for(tiny_model_dir, run_dir, *PPO_FLAGS, "--num-rollout", str(ROLLOUTS),
                        "--save", str(run_dir / "ckpt"), "--save-interval", "6")
    summary = anyio.run(run_training, config)
    assert summary["rollouts"] == ROLLOUTS and summary["train_steps"] == ROLLOUTS
    return run_dir


def test_ppo_with_a_critic_learns_and_its_value_loss_falls(ppo_run: Path) -> None:
    rows = read_metrics(ppo_run / "metrics.jsonl")
    scores = [row["rollout/reward_mean"] - 1.0 for row in rows]  # the task's score, as the GRPO run's reward
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last >= 2 * first, scores
    value_losses = [row["train/critic/value_loss"] for row in rows]
    # the fresh head predicts 0 for returns near 1; the critic learns their level
    assert value_losses[0] > 0.5 and max(value_losses[-3:]) < 0.25 * value_losses[0], value_losses
    # --num-critic-only-steps 2: rollouts 0 and 1 trained the critic alone (no policy gradient), then both
    assert [(row["train/pg_loss"], row["train/grad_norm"]) for row in rows[:2]] == [(0.0, 0.0)] * 2
    assert all(row["train/grad_norm"] > 0 for row in rows[2:])
    assert (ppo_run / "ckpt" / "rollout_5" / "critic_scheduler.json").is_file()


def test_a_ppo_run_resumes_exactly_critic_included(ppo_run: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(ppo_run / "metrics.jsonl", tmp_path / "metrics.jsonl")
    config = config_for(tiny_model_dir, tmp_path, *PPO_FLAGS, "--num-rollout", "8",
                        "--load", str(ppo_run / "ckpt" / "rollout_5"))
    summary = anyio.run(run_training, config)
    assert summary["rollouts"] == 2
    original, resumed = read_metrics(ppo_run / "metrics.jsonl")[6:8], read_metrics(tmp_path / "metrics.jsonl")[6:]
    for key in ("rollout/reward_mean", "train/loss", "train/grad_norm", "train/critic/value_loss",
                "train/critic/values"):
        assert [row[key] for row in resumed] == pytest.approx([row[key] for row in original], abs=1e-6), key


async def test_async_rollout_overlaps_generation_within_the_staleness_bound(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    # the staleness bound needs neither a second engine nor a second rank, nor big batches; PPO (a critic) runs
    # async only with an off-policy correction, as miles (without one: refused at start-up, tests/unit/test_config)
    config = config_for(tiny_model_dir, tmp_path, "--rollout-num-engines", "1", "--num-rollout", "4",
                        "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
                        "--async-rollout", "--max-weight-staleness", "1", "--advantage-estimator", "ppo",
                        "--use-tis", "--save-debug-rollout-data", str(tmp_path / "dumps" / "{rollout_id}.rld"))
    summary = await run_training(config)
    assert summary["train_steps"] == 4 and summary["final_weight_version"] == "4"
    rows = read_metrics(tmp_path / "metrics.jsonl")
    for rollout_id in range(4):
        samples = read_dump(dump_path(str(tmp_path / "dumps" / "{rollout_id}.rld"), rollout_id)).samples
        versions = {int(v) for s in samples for v in s.weight_versions}
        # rollout k trains at policy version k; its samples come from versions k-1 .. k (one step off policy)
        assert versions and min(versions) >= rollout_id - 1 and max(versions) <= rollout_id, (rollout_id, versions)
        # the step's staleness histogram: its samples by how many versions behind their first token's weights were
        histogram = {int(key.rsplit("/", 1)[1]): value for key, value in rows[rollout_id].items()
                     if key.startswith("rollout/staleness/")}
        behind = [rollout_id - int(s.weight_versions[0]) for s in samples]
        assert histogram == {k: float(behind.count(k)) for k in set(behind)}, (rollout_id, histogram)
        assert sum(histogram.values()) == len(samples) == 32


async def test_debug_rollout_only_generates_and_dumps_without_training_ranks(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    template = str(tmp_path / "dumps" / "{rollout_id}.rld")
    config = config_for(tiny_model_dir, tmp_path, "--rollout-num-engines", "1", "--num-rollout", "2",
                        "--debug-rollout-only", "--save-debug-rollout-data", template,
                        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2")  # what is checked needs few
    summary, children = await run_watched(config)
    assert summary["rollouts"] == 2 and summary["train_steps"] == 0
    assert not [c for c in children if "train_rank" in c or "torch.distributed.run" in c], children
    assert any("workers.engine" in c for c in children)
    for rollout_id in range(2):
        assert len(read_dump(dump_path(template, rollout_id)).samples) == 4 * 2
