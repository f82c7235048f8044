"""A real torchrun group of 2 CPU ranks (gloo) with the tiny model, driven through TrainGroup.

One module-scoped run trains three rollouts (saving a checkpoint and exporting weights on the way), ends by
cancellation (how a run ends) and records what it saw; the tests check that record. A second, fresh group resumes from the checkpoint and
must reproduce the losses exactly; then one of its ranks is SIGKILLed mid-step. No process may outlive
its test.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import torch

from coordinator.train.errors import RankFailure
from coordinator.train.group import TrainGroup
from coordinator.train.planning import balance_by_tokens, plan_steps, reduce_step_metrics
from coordinator.train.torchrun import TorchrunSpec
from tests.support.train_samples import TRAIN_CONFIG, as_samples, synthetic_samples
from tests.support.train_settings import flat_settings, init_command
from tests.support.waiting import wait_until
from workers import protocol
from workers.protocol.train_settings import BatchingSettings, SettingsError
from workers.train_rank.checkpoint import CheckpointError, resolve_checkpoint
from workers.train_rank.trainer import Trainer

METRICS = [
    "loss",
    "pg_loss",
    "pg_clipfrac",
    "kl",
    "entropy",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "num_tokens",
    "train_rollout_logprob_abs_diff_mean",
    "train_rollout_logprob_abs_diff_max",
]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@dataclass
class FirstRun:
    rollouts: list[list[protocol.WireSample]]
    init_info: dict[str, Any]
    metrics: list[dict[str, float]] = field(default_factory=list)
    step_metrics: list[list[dict[str, float]]] = field(default_factory=list)
    checkpoint: Path | None = None
    export_after_0: Path | None = None
    export_after_2: Path | None = None
    manifest: list[tuple[str, str, list[int]]] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    log_path: Path | None = None
    torchrun_returncode: int | None = None
    lone_export: Path | None = None


def config_for(model_dir: Path, save_dir: Path) -> dict[str, Any]:
    return {**TRAIN_CONFIG, "model_path": str(model_dir), "save_dir": str(save_dir)}


@pytest.fixture(scope="module")
async def first_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> FirstRun:
    root = tmp_path_factory.mktemp("train-group")
    rollouts = [synthetic_samples(tiny_model_dir, 8, seed=10 + index) for index in range(3)]
    with anyio.fail_after(240):
        async with anyio.create_task_group() as tg:
            # grace_s: see test_a_cancelled_group_shuts_its_ranks_down_and_torchrun_exits_0
            group: TrainGroup = await tg.start(TrainGroup(TorchrunSpec(nproc_per_node=2), run_dir=root / "run", grace_s=60).run)
            record = FirstRun(
                rollouts=rollouts, init_info=await group.commands.init(flat_settings(config_for(tiny_model_dir, root / "ckpt")))
            )
            record.pids = [info.pid for info in group.ranks.values()] + [group.torchrun_pid or 0]
            record.log_path = group.log_path
            for rollout_id, raw in enumerate(rollouts):
                record.metrics.append(await group.commands.train(rollout_id, as_samples(raw)))
                record.step_metrics.append(group.commands.step_metrics)
                if rollout_id == 0:
                    extra = {"data_source": {"epoch": 0, "offset": 8}}
                    await group.commands.save(0, extra={"data_source": {"epoch": 0, "offset": 0}})
                    record.checkpoint = await group.commands.save(0, extra=extra)  # a re-save of the same rollout
                    record.export_after_0 = await group.commands.export_weights(root / "weights", weight_version=1)
            record.export_after_2 = await group.commands.export_weights(root / "weights", weight_version=3)
            record.manifest = await group.commands.weight_manifest()
            # a global batch of 1 on the 2 replicas: each step, one rank has the sample and one an empty shard
            await group.commands.init(flat_settings({**config_for(tiny_model_dir, root / "ckpt-lone"),
                                                     "global_batch_size": 1}))
            await group.commands.train(0, as_samples(rollouts[0][:2]))
            record.lone_export = await group.commands.export_weights(root / "lone", weight_version=1)
            tg.cancel_scope.cancel()
    assert group.torchrun is not None and group.torchrun.proc is not None
    record.torchrun_returncode = group.torchrun.proc.returncode
    return record


async def test_training_reports_finite_metrics_per_step(first_run: FirstRun) -> None:
    assert first_run.init_info.num_parameters > 0
    for metrics in first_run.metrics:
        for key in METRICS:
            assert key in metrics and math.isfinite(metrics[key]), key
        assert metrics["num_steps"] == 2  # 8 samples, global batch of 4
    assert [len(steps) for steps in first_run.step_metrics] == [2, 2, 2]
    # Megatron's warm-up over two optimizer steps: step s runs at lr·s/2, so 0, then half the lr.
    assert [step["lr"] for step in first_run.step_metrics[0]] == pytest.approx([0.0, 5e-4])
    assert [step["lr"] for step in first_run.step_metrics[1]] == pytest.approx([1e-3, 1e-3])
    # The reference is the initial model: zero KL at the first step, then the policy moves away.
    assert first_run.step_metrics[0][0]["kl"] == pytest.approx(0.0, abs=1e-9)
    assert first_run.step_metrics[2][-1]["kl"] > 0


async def test_a_replica_given_no_sample_in_a_step_keeps_the_update_one_processs(
    first_run: FirstRun, tiny_model_dir: Path
) -> None:
    """A global batch smaller than the ranks: the replica with no sample runs one empty micro-batch and joins the
    gradient all-reduce with zeros, so two steps of one sample each update as one process does, bit for bit."""
    from transformers import AutoModelForCausalLM

    lone = first_run.rollouts[0][:2]
    assert [sorted(len(s) for s in step.shards) for step in plan_steps(lone, BatchingSettings(global_batch_size=1), 2)
            ] == [[0, 1]] * 2
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command({**config_for(tiny_model_dir, Path("unused")), "global_batch_size": 1}))
    trainer.train(protocol.TrainCommand(0, [lone[:1], lone[1:]], [int(sample.loss_mask.sum()) for sample in lone]))
    assert first_run.lone_export is not None
    got = AutoModelForCausalLM.from_pretrained(str(first_run.lone_export), dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).state_dict()
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(got[name], tensor), name
    assert any(not torch.equal(tensor, base[name]) for name, tensor in got.items()), "the two steps trained"


async def test_recomputed_logprobs_match_the_rollout_logprobs(first_run: FirstRun) -> None:
    first = first_run.metrics[0]
    assert first["train_rollout_logprob_abs_diff_max"] < 1e-4
    assert first["train_rollout_logprob_abs_diff_mean"] < 1e-5
    # Later rollouts were generated (here: scored) with the initial weights, so the trained model differs.
    assert first_run.metrics[2]["train_rollout_logprob_abs_diff_max"] > 1e-4


async def test_exported_snapshot_loads_and_equals_single_process_training(
    first_run: FirstRun, tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    assert first_run.export_after_0 is not None and first_run.export_after_0.name == "weights-1"
    exported = AutoModelForCausalLM.from_pretrained(
        str(first_run.export_after_0), dtype=torch.float32
    ).state_dict()
    # The same rollout trained in this process, unsplit: two data-parallel ranks must give the same update.
    trainer = Trainer(rank=0, world_size=1, device=torch.device("cpu"))
    trainer.init(init_command(config_for(tiny_model_dir, Path("unused"))))
    raw = first_run.rollouts[0]
    steps = [raw[:4], raw[4:]]
    trainer.train(protocol.TrainCommand(0, steps, [sum(sum(s.loss_mask) for s in step) for step in steps]))
    expected = trainer.model.state_dict()
    initial = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).state_dict()
    assert set(exported) == set(expected)
    assert any(not torch.equal(exported[name], initial[name]) for name in expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    assert [name for name, _, _ in first_run.manifest] == [n for n in expected if n != "lm_head.weight"]


async def test_resume_in_a_fresh_group_reproduces_losses_then_a_killed_rank_fails_the_call(
    first_run: FirstRun, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    assert first_run.checkpoint is not None and first_run.export_after_2 is not None
    save_dir = first_run.checkpoint.parent
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "rollout_0"]  # the re-save left nothing
    # `latest` broken (it names a checkpoint that is gone): refused with the choices, never picked for the user
    # (the coordinator refuses it before any rank reads it); the step the message offers is then loaded
    broken = tmp_path / "broken"
    shutil.copytree(save_dir, broken)
    (broken / "latest").write_text('"rollout_2"')
    with pytest.raises(CheckpointError, match=r"names rollout_2, .* pick one with --ckpt-step N"):
        resolve_checkpoint(broken)
    assert all(gone(pid) for pid in first_run.pids), "the first group left processes behind"
    pids: list[int] = []
    with anyio.fail_after(240):
        async with anyio.create_task_group() as tg:
            group: TrainGroup = await tg.start(TrainGroup(TorchrunSpec(nproc_per_node=2), run_dir=tmp_path / "run").run)
            pids = [info.pid for info in group.ranks.values()] + [group.torchrun_pid or 0]
            await group.commands.init(flat_settings(config_for(tiny_model_dir, tmp_path / "ckpt")))
            info = await group.commands.load_checkpoint(resolve_checkpoint(broken, 0))
            assert info.rollout_id == 0 and info.extra == {"data_source": {"epoch": 0, "offset": 8}}
            assert info.path == str(broken / "rollout_0")  # LoadReply: plain data on the wire
            for rollout_id in (1, 2):
                metrics = await group.commands.train(rollout_id, as_samples(first_run.rollouts[rollout_id]))
                for key in ("loss", "pg_loss", "grad_norm", "kl", "entropy", "lr"):
                    assert metrics[key] == first_run.metrics[rollout_id][key], (rollout_id, key)
            resumed = await group.commands.export_weights(tmp_path / "weights", weight_version=3)
            original = load_file(str(first_run.export_after_2 / "model.safetensors"))
            for name, tensor in load_file(str(resumed / "model.safetensors")).items():
                assert torch.equal(tensor, original[name]), name

            # A rank killed mid-step: the call fails at once, naming the rank; nothing hangs.
            victim = group.ranks[1].pid
            # 32 optimizer steps: ~1.3 s of rank 1's CPU time, so the kill below lands inside the call
            big = as_samples(first_run.rollouts[0] * 64)
            failure: list[BaseException] = []
            returned: list[bool] = []

            async def train_and_record() -> None:
                try:
                    await group.commands.train(3, big)
                    returned.append(True)
                except RankFailure as exc:
                    failure.append(exc)

            def computed() -> float:
                """rank 1's CPU seconds since the call was made (idle, a rank blocks on its socket)."""
                assert not returned, "train() returned before rank 1 could be killed mid-call"
                return sum(process.cpu_times()[:2]) - cpu_before

            process = psutil.Process(victim)
            cpu_before = sum(process.cpu_times()[:2])
            async with anyio.create_task_group() as inner:
                inner.start_soon(train_and_record)
                await wait_until(computed, until=lambda seconds: seconds >= 0.3, timeout=120,
                                 what="rank 1 computing the train call (0.3 s of its CPU time)")
                os.kill(victim, signal.SIGKILL)
            assert failure, "train() returned although rank 1 was killed"
            assert isinstance(failure[0], RankFailure) and 1 in failure[0].ranks
            assert "rank 1" in str(failure[0]) and str(group.log_path) in str(failure[0])
            with pytest.raises(RankFailure):
                await group.commands.weight_manifest()
            tg.cancel_scope.cancel()
    for pid in pids:
        assert gone(pid), f"process {pid} outlived its TrainGroup"


def wire(length: int, loss_tokens: int) -> protocol.WireSample:
    return protocol.WireSample(
        tokens=[5] * length,
        response_length=loss_tokens,
        loss_mask=[1] * loss_tokens,
        rollout_log_probs=[0.0] * loss_tokens,
    )


def test_steps_are_cut_in_order_and_balanced_by_tokens() -> None:
    samples = [wire(length, 2) for length in (10, 3, 3, 4, 9, 1, 1, 1)]
    plan = plan_steps(samples, BatchingSettings(global_batch_size=4), world_size=2)
    assert len(plan) == 2 and [step.loss_tokens for step in plan] == [8, 8]
    loads = [[sum(len(s.tokens) for s in shard) for shard in step.shards] for step in plan]
    assert loads == [[10, 10], [9, 3]]  # longest first onto the lighter rank
    assert plan_steps(samples, BatchingSettings(num_steps_per_rollout=4), world_size=2)[0].shards == [
        [samples[0]],
        [samples[1]],
    ]
    assert len(plan_steps(samples, BatchingSettings(), world_size=2)) == 1
    assert balance_by_tokens([5, 5, 5, 5, 5], 3) == [[0, 3], [1, 4], [2]]


def test_a_dynamic_global_batch_is_one_step_rounded_down_to_the_ranks() -> None:
    """miles' --use-dynamic-global-batch-size: however many samples a rollout returned, one optimizer step over
    them rounded down to a multiple of the data-parallel ranks (the rest dropped, as miles trims them)."""
    dynamic = BatchingSettings(dynamic_global_batch_size=True)
    for count, kept in ((8, 8), (7, 6), (3, 2)):
        samples = [wire(4, 1) for _ in range(count)]
        [step] = plan_steps(samples, dynamic, world_size=2)
        assert sum(len(shard) for shard in step.shards) == kept and step.loss_tokens == kept
        assert [s for shard in step.shards for s in shard] == samples[:kept]


def test_step_metrics_add_up_over_ranks_as_token_means() -> None:
    def rank(loss: float, tokens: float, diff_max: float, seconds: float, grad_norm: float) -> protocol.StepMetrics:
        return protocol.StepMetrics(
            loss=loss,
            pg_loss=loss,
            loss_tokens=tokens,
            clipped_tokens=tokens / 2,
            entropy_sum=tokens,
            kl_sum=0.0,
            logprob_abs_diff_sum=tokens / 4,
            num_tokens=3 * tokens,
            logprob_abs_diff_max=diff_max,
            grad_norm=grad_norm,
            lr=1e-3,
            step_time_s=seconds,
        )

    step = reduce_step_metrics([rank(0.25, 6.0, 0.5, 2.0, 1.5), rank(0.5, 2.0, 0.75, 1.0, 9.0)])
    assert step["loss"] == 0.75 and step["loss_tokens"] == 8.0 and step["num_tokens"] == 24.0
    assert step["pg_clipfrac"] == 0.5 and step["entropy"] == 1.0
    assert step["train_rollout_logprob_abs_diff_mean"] == 0.25 and step["train_rollout_logprob_abs_diff_max"] == 0.75
    # the slowest rank sets the step time; grad norm and lr are rank 0's (all-reduced, the same everywhere)
    assert step["step_time_s"] == 2.0 and step["tokens_per_s"] == 12.0 and step["grad_norm"] == 1.5


def test_batch_settings_that_cannot_work_are_rejected_with_the_setting_named() -> None:
    samples = [wire(6, 2) for _ in range(6)]
    with pytest.raises(ValueError, match="not a multiple of global_batch_size=4"):
        plan_steps(samples, BatchingSettings(global_batch_size=4), world_size=2)
    # fewer samples a step than ranks: the others get an empty shard (they run one empty micro-batch)
    small = plan_steps(samples, BatchingSettings(global_batch_size=2), world_size=4)
    assert [sorted(len(shard) for shard in step.shards) for step in small] == [[0, 0, 1, 1]] * 3
    assert [step.loss_tokens for step in small] == [4] * 3
    with pytest.raises(SettingsError, match=r"either batching\.global_batch_size or batching\.num_steps_per_rollout"):
        BatchingSettings(global_batch_size=2, num_steps_per_rollout=3)
    with pytest.raises(ValueError, match="no samples"):
        plan_steps([], BatchingSettings(), world_size=1)


def test_torchrun_command_single_and_multi_node(tmp_path: Path) -> None:
    single = TrainGroup(TorchrunSpec(nproc_per_node=2), run_dir=tmp_path).torchrun_command()
    assert single[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(tmp_path / "torchrun"),
        "--standalone",
        "--max-restarts",
        "0",
        "-m",
        "workers.train_rank",
    ]
    multi = TrainGroup(
        TorchrunSpec(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400", max_restarts=3),
        run_dir=tmp_path,
    )
    command = multi.torchrun_command()
    assert command[command.index("--nnodes") + 1] == "2" and command[command.index("--node-rank") + 1] == "1"
    assert command[command.index("--rdzv-endpoint") + 1] == "10.0.0.1:29400"
    assert command[command.index("--max-restarts") + 1] == "3" and multi.world_size == 16
    assert all(multi.token not in part for part in command)  # the token travels in the environment only
    with pytest.raises(ValueError, match="needs rdzv_endpoint"):
        TrainGroup(TorchrunSpec(nproc_per_node=1, nnodes=2), run_dir=tmp_path)


async def test_a_cancelled_group_shuts_its_ranks_down_and_torchrun_exits_0(first_run: FirstRun) -> None:
    """Cancelling run() (how a run ends, on success or on a signal) still reaches the ranks with their shutdown
    command before the connections close: every rank returns, torchrun exits 0, its log holds no failure.

    The clean exit is given time to finish (`grace_s`, the wait before SIGTERM, which bounds a run's stop):
    with the default 5 s, torchrun was SIGTERMed mid clean exit on a loaded box (measured 2.2-5.9 s from the
    shutdown to torchrun's exit on 2 cores with two busy loops): returncode -15 or 1, not a failed shutdown.
    The module's run is that cancelled group (a group of its own for this alone would start 3 more processes)."""
    assert first_run.log_path is not None
    log = first_run.log_path.read_text()
    assert first_run.torchrun_returncode == 0, log[-3000:]
    assert "ChildFailedError" not in log and "lost the control channel" not in log, log[-3000:]


async def test_ranks_that_die_before_connecting_fail_start_with_the_log(tmp_path: Path) -> None:
    group = TrainGroup(TorchrunSpec(nproc_per_node=2), run_dir=tmp_path, extra_env={"RAYLESS_TORCH_THREADS": "many"})
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            with pytest.raises(
                RankFailure, match=r"torchrun exited with code \d+ before all ranks connected \(0/2\)"
            ) as info:
                await tg.start(group.run)
    assert info.value.ranks == [0, 1]
    assert "invalid literal for int()" in str(info.value)
    assert group.torchrun_pid is not None and gone(group.torchrun_pid)
