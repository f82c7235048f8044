"""The sharded path on CPU: a real torchrun group of 2 ranks running FSDP2 over gloo (`data_parallel: "fsdp"`),
the policy and the reference built on the meta device and loaded shard by shard, packed micro-batches whose
first-fit-decreasing counts differ between the ranks (so the ranks must agree on one count, or FSDP2's
collectives would hang), and, in the LoRA run, a global batch of 3 samples that 2 ranks split 2 + 1. The update equals one process training the same steps unsharded, with and without
LoRA, and with PPO's critic (sharded as the policy; the advantages whitened over both ranks); after the first step the process group's timeout is the short one, so a rank that stops is reported in
seconds. One group (module fixture) is initialised three times, full, LoRA, then PPO (a re-init replaces the
model, as train FT's does), and stopped last: one torchrun and two ranks serve every test here."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from coordinator.train.errors import RankCommandError, RankFailure
from coordinator.train.group import TrainGroup
from coordinator.train.planning import plan_steps
from coordinator.train.torchrun import TorchrunSpec
from tests.support.train_samples import TRAIN_CONFIG, as_samples, synthetic_samples
from tests.support.train_settings import flat_settings, init_command
from workers import protocol
from workers.protocol.train_settings import BatchingSettings, CriticSettings, ReturnsSettings, TrainSettings
from workers.train_rank.packing import first_fit_decreasing
from workers.train_rank.trainer import Trainer

BUDGET = 14


def config_for(model_dir: Path, **extra: object) -> dict[str, object]:
    return {**TRAIN_CONFIG, "model_path": str(model_dir), "max_tokens_per_micro_batch": BUDGET,
            "log_probs_chunk_size": 4, "global_batch_size": 6, **extra}


def ppo_settings(model_dir: Path, **extra: object) -> TrainSettings:
    return flat_settings(config_for(model_dir, **extra)).replace(
        returns=ReturnsSettings(estimator="ppo", gamma=0.9, lambd=0.95, normalize=True),
        critic=CriticSettings(lr=1e-2))


LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "exclude_modules": [], "adapter_path": None}


@dataclass
class ShardedRun:
    raw: list[protocol.WireSample]
    lora_raw: list[protocol.WireSample]
    metrics: dict[str, Any]
    exported: Path
    lora_info: dict[str, Any]
    lora_exported: Path
    ppo_metrics: dict[str, Any]
    ppo_exported: Path
    lone_metrics: dict[str, Any]
    lone_exported: Path
    failure: BaseException


@pytest.fixture(scope="module")
async def sharded_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ShardedRun:
    tmp_path = tmp_path_factory.mktemp("sharded")
    raw = synthetic_samples(tiny_model_dir, 12, seed=21)
    lora_raw = synthetic_samples(tiny_model_dir, 12, seed=22)
    with anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            group: TrainGroup = await tg.start(TrainGroup(TorchrunSpec(nproc_per_node=2), run_dir=tmp_path / "run").run)
            await group.commands.init(flat_settings(config_for(tiny_model_dir, data_parallel="fsdp", train_pg_timeout_s=3)))
            metrics = await group.commands.train(0, as_samples(raw))
            exported = await group.commands.export_weights(tmp_path / "weights", weight_version=1)
            # the process group's timeout is the short one from here on (set after that first step)
            # a global batch that is not a multiple of the ranks: each step's 3 samples go 2 + 1
            lora_info = await group.commands.init(flat_settings(config_for(tiny_model_dir, data_parallel="fsdp", lora=LORA,
                                                                  lr=1e-2, train_pg_timeout_s=3, global_batch_size=3)))
            await group.commands.train(0, as_samples(lora_raw))
            lora_exported = await group.commands.export_weights(tmp_path / "lora-weights", weight_version=1)
            await group.commands.init(ppo_settings(tiny_model_dir, data_parallel="fsdp", train_pg_timeout_s=3))
            ppo_metrics = await group.commands.train(0, as_samples(raw))
            ppo_exported = await group.commands.export_weights(tmp_path / "ppo-weights", weight_version=1)
            # a global batch of 1 on 2 ranks: in each step one rank has the sample, the other an empty shard
            await group.commands.init(flat_settings(config_for(tiny_model_dir, data_parallel="fsdp", train_pg_timeout_s=3,
                                                               global_batch_size=1)))
            lone_metrics = await group.commands.train(0, as_samples(raw[:2]))
            lone_exported = await group.commands.export_weights(tmp_path / "lone-weights", weight_version=1)

            # A stopped rank: the other's collective gives up after 3 s, not 600.
            victim = group.ranks[1].pid
            os.kill(victim, signal.SIGSTOP)
            try:
                with anyio.fail_after(60), pytest.raises((RankCommandError, RankFailure)) as failure:
                    await group.commands.train(1, as_samples(lora_raw))
            finally:
                os.kill(victim, signal.SIGCONT)
            tg.cancel_scope.cancel()
    return ShardedRun(raw, lora_raw, metrics, exported, lora_info, lora_exported, ppo_metrics, ppo_exported,
                      lone_metrics, lone_exported, failure.value)


def one_process(model_dir: Path, raw: list[protocol.WireSample], step: int = 6, **extra: object) -> Trainer:
    """The same rollout trained unsharded in this process, in steps of `step` samples (the same seed, so the
    same initial adapters)."""
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command(config_for(model_dir, global_batch_size=step, **extra)))
    parts = [raw[start : start + step] for start in range(0, len(raw), step)]
    trainer.train(protocol.TrainCommand(0, parts, [sum(sum(s.loss_mask) for s in part) for part in parts]))
    return trainer


async def test_ppo_with_a_sharded_critic_trains_as_one_process_does(sharded_run: ShardedRun,
                                                                    tiny_model_dir: Path) -> None:
    """The critic sharded as the policy (its value head fresh on rank 0, broadcast), each rank's GAE on its own
    values, the whitening's statistics all-reduced: the policy and the critic update as in one process."""
    from transformers import AutoModelForCausalLM

    raw = sharded_run.raw
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command(ppo_settings(tiny_model_dir)))
    answer = trainer.train(protocol.TrainCommand(0, [raw[:6], raw[6:]], [sum(sum(s.loss_mask) for s in part)
                                                                          for part in (raw[:6], raw[6:])]))
    expected = trainer.model.state_dict()
    got = AutoModelForCausalLM.from_pretrained(str(sharded_run.ppo_exported), dtype=torch.float32).state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    # the second step's value loss is measured after the critic's first update: the sharded critic trained alike
    value_losses = [step.extra["critic/value_loss"] / step.loss_tokens for step in answer.steps]
    assert sharded_run.ppo_metrics["critic/value_loss"] == pytest.approx(sum(value_losses) / 2, abs=1e-6)
    assert value_losses[1] != value_losses[0]


async def test_fsdp_on_cpu_matches_one_process(sharded_run: ShardedRun, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    raw = sharded_run.raw
    steps = plan_steps(raw, BatchingSettings(global_batch_size=6), 2)
    counts = [[len(first_fit_decreasing([len(s.tokens) for s in shard], BUDGET)) for shard in step.shards]
              for step in steps]
    assert any(len(set(step)) > 1 for step in counts), f"the ranks' plans should differ somewhere: {counts}"
    assert sharded_run.metrics["num_steps"] == 2 and sharded_run.metrics["kl"] == pytest.approx(0.0, abs=1e-7)

    expected = one_process(tiny_model_dir, raw).model.state_dict()
    got = AutoModelForCausalLM.from_pretrained(str(sharded_run.exported), dtype=torch.float32).state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=1e-5, msg=name)


async def test_a_rank_given_no_sample_in_a_step_runs_an_empty_one_and_the_update_is_one_processs(
        sharded_run: ShardedRun, tiny_model_dir: Path) -> None:
    """A global batch smaller than the ranks (miles' multi-node scripts size it for their data-parallel size):
    the rank with no sample runs one empty micro-batch through FSDP2's collectives, and the two steps update the
    weights as one process training the same two samples one at a time."""
    from transformers import AutoModelForCausalLM

    lone = sharded_run.raw[:2]
    steps = plan_steps(lone, BatchingSettings(global_batch_size=1), 2)
    assert [sorted(len(shard) for shard in step.shards) for step in steps] == [[0, 1]] * 2
    assert sharded_run.lone_metrics["num_steps"] == 2
    assert sharded_run.lone_metrics["loss_tokens"] == sum(int(sample.loss_mask.sum()) for sample in lone)
    expected = one_process(tiny_model_dir, lone, step=1).model.state_dict()
    got = AutoModelForCausalLM.from_pretrained(str(sharded_run.lone_exported), dtype=torch.float32).state_dict()
    moved = 0
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
        moved += not torch.equal(tensor, base[name])
    assert moved > 0, "the two steps trained"


async def test_a_stopped_rank_times_out_fast_after_the_first_step(sharded_run: ShardedRun) -> None:
    assert "rank(s) 0" in str(sharded_run.failure) and "Timed out waiting 3000ms" in str(sharded_run.failure)


async def test_lora_adapters_under_fsdp_on_cpu_train_as_one_process_does(sharded_run: ShardedRun, tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """LoRA on the sharded path: the adapters are injected into the meta model before sharding and their initial
    weights broadcast from rank 0, so 2 FSDP2 ranks train the same adapters as one unsharded process (same seed)
    and the engines get the same merged weights. Its global batch (3) is not a multiple of the ranks: each step's
    samples go 2 + 1, and the update is still one process's."""
    from transformers import AutoModelForCausalLM

    info = sharded_run.lora_info
    assert 0 < info.trainable_parameters < info.num_parameters
    steps = plan_steps(sharded_run.lora_raw, BatchingSettings(global_batch_size=3), 2)
    assert [sorted(len(shard) for shard in step.shards) for step in steps] == [[1, 2]] * 4
    trainer = one_process(tiny_model_dir, sharded_run.lora_raw, step=3, lora=LORA, lr=1e-2)
    one = trainer.export_weights(protocol.ExportWeightsCommand(str(tmp_path / "one"), "1")).path
    expected = AutoModelForCausalLM.from_pretrained(str(one), dtype=torch.float32)
    got = AutoModelForCausalLM.from_pretrained(str(sharded_run.lora_exported), dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).state_dict()
    moved = 0
    for name, tensor in expected.state_dict().items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
        moved += not torch.equal(tensor, base[name])
    assert moved > 0, "the adapters trained: merged weights differ from the base model"
