"""The training loop: rollouts in, train steps, weight syncs and checkpoints out.

Owns the order of one run: for each rollout id, get a batch from the rollout manager (generated or replayed:
the loop cannot tell), train on it, push the new weights to the engines, save on the interval. Two schedules:

- synchronous: generate k → train k → sync (weights version k+1) → generate k+1 ...
- one-step-off-policy (`--async-rollout`): a producer task generates rollout k+1 while step k trains. The
  producer may start rollout r only once the policy version is ≥ r - max_weight_staleness, and hands batches
  over a zero-buffer stream, so staleness is bounded by structure, not filtered afterwards.

Invariant: the weight version names the number of optimizer updates applied to the policy, as a string
("0" = `--hf-checkpoint`); after the sync of step k every engine reports str(k + 1).

Train FT (`Config.train_ft_enabled` only): a step that fails with `RankFailure` waits for torchrun's restart
(`trainer.recover()`: ranks reconnect, are initialised again and load the last checkpoint) and is sent again,
at most `--max-restarts` times; engines are not touched. Without train FT the failure ends the run, naming the
rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from coordinator.config import Config
from coordinator.progress import MetricsLog
from replay.sample import RolloutBatch

log = logging.getLogger("rayless")


class RolloutSource(Protocol):
    async def get_rollout(self, rollout_id: int, weight_version: str) -> RolloutBatch: ...

    def state_dict(self) -> dict[str, Any]: ...


class Trainer(Protocol):
    async def train(self, rollout_id: int, samples: list[Any]) -> dict[str, float]: ...

    async def save(self, rollout_id: int, extra: dict[str, Any]) -> Any: ...


class Syncer(Protocol):
    async def update(self, version: str) -> dict[str, float]: ...


class StepHook(Protocol):
    async def after_step(self, rollout_id: int, weight_version: str) -> None: ...


@dataclass
class LoopResult:
    rollouts: int = 0
    train_steps: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


class TrainingLoop:
    def __init__(
        self,
        *,
        config: Config,
        rollouts: RolloutSource,
        trainer: Trainer | None,
        weight_sync: Syncer | None,
        metrics: MetricsLog,
        start_rollout: int = 0,
        num_rollout: int,
        hooks: list[StepHook] | None = None,
    ) -> None:
        self.config = config
        self.rollouts = rollouts
        self.trainer = trainer
        self.weight_sync = weight_sync
        self.metrics = metrics
        self.start_rollout = start_rollout
        self.num_rollout = num_rollout
        self.hooks = hooks or []
        self.version = start_rollout  # optimizer updates applied so far
        self.train_recoveries = 0
        self._rank_generation: dict[int, int] | None = None  # train FT: restart count of each rank at init
        self._version_changed = anyio.Event()

    @property
    def weight_version(self) -> str:
        return str(self.version)

    async def run(self) -> LoopResult:
        result = LoopResult()
        if self.config.async_rollout and self.trainer is not None:
            await self._run_async(result)
        else:
            for rollout_id in range(self.start_rollout, self.num_rollout):
                started = time.monotonic()
                batch = await self.rollouts.get_rollout(rollout_id, self.weight_version)
                await self._train_and_sync(batch, result, started)
        return result

    async def _run_async(self, result: LoopResult) -> None:
        send, receive = anyio.create_memory_object_stream[tuple[RolloutBatch, float]](max_buffer_size=0)
        staleness = self.config.max_weight_staleness

        async def produce() -> None:
            async with send:
                for rollout_id in range(self.start_rollout, self.num_rollout):
                    while self.version < rollout_id - staleness:
                        await self._version_changed.wait()
                    started = time.monotonic()
                    batch = await self.rollouts.get_rollout(rollout_id, self.weight_version)
                    await send.send((batch, started))

        async with anyio.create_task_group() as group:
            group.start_soon(produce)
            async with receive:
                async for batch, started in receive:
                    oldest = min((int(v) for s in batch.samples for v in s.weight_versions[:1] if v.isdigit()),
                                 default=self.version)
                    if self.version - oldest > staleness:
                        raise RuntimeError(
                            f"rollout {batch.rollout_id} holds samples from weight version {oldest}, "
                            f"{self.version - oldest} behind the policy; --max-weight-staleness is {staleness}"
                        )
                    await self._train_and_sync(batch, result, started)

    async def _train_and_sync(self, batch: RolloutBatch, result: LoopResult, started: float) -> None:
        rollout_id = batch.rollout_id
        record: dict[str, Any] = dict(batch.metrics)
        record["rollout/samples"] = float(len(batch.samples))
        rewards = [s.scalar_reward(self.config.reward_key) for s in batch.samples if s.reward is not None]
        if rewards and "rollout/reward_mean" not in record:
            record["rollout/reward_mean"] = sum(rewards) / len(rewards)
        result.rollouts += 1
        if self.trainer is not None:
            train_started = time.monotonic()
            train_metrics = await self._train_step(rollout_id, batch.samples)
            record.update({key if key.startswith("train/") else f"train/{key}": value
                           for key, value in train_metrics.items()})
            record["train/time_s"] = time.monotonic() - train_started
            result.train_steps += 1
            self.version += 1
            self._version_changed.set()
            self._version_changed = anyio.Event()
            if self.weight_sync is not None:
                record.update(await self.weight_sync.update(self.weight_version))
            if self.config.save and self.config.save_interval and (rollout_id + 1) % self.config.save_interval == 0:
                await self.save(rollout_id)
        record["weight_version"] = self.weight_version
        record["step/time_s"] = time.monotonic() - started
        self.metrics.log(rollout_id, record)
        result.history.append({"step": rollout_id, **record})
        log.info(_summary(rollout_id, self.num_rollout, record))
        for hook in self.hooks:
            await hook.after_step(rollout_id, self.weight_version)

    async def _train_step(self, rollout_id: int, samples: list[Any]) -> dict[str, float]:
        assert self.trainer is not None
        if not self.config.train_ft_enabled:
            return await self.trainer.train(rollout_id, samples)
        from coordinator.train_group import RankFailure

        group: Any = self.trainer
        if self._rank_generation is None:
            self._rank_generation = _generation(group)
        while True:
            # torchrun may have restarted the ranks while we generated: they are back but hold no model yet.
            if len(group.ranks) < group.world_size or _generation(group) != self._rank_generation:
                if self.train_recoveries >= self.config.max_restarts:
                    raise RankFailure(sorted(set(range(group.world_size)) - set(group.ranks)),
                                      f"train FT gave up after {self.train_recoveries} recoveries (--max-restarts)")
                self.train_recoveries += 1
                log.warning("train FT: ranks failed before rollout %d's step; waiting for the restarted ranks "
                            "(recovery %d of at most %d)", rollout_id, self.train_recoveries,
                            self.config.max_restarts)
                loaded = await recover_train_group(group, failed_generation=max(self._rank_generation.values(),
                                                                                 default=0))
                self._rank_generation = _generation(group)
                log.warning("train FT: ranks are back%s; sending rollout %d's step",
                            f" from checkpoint {loaded.path}" if loaded is not None else " from the initial model",
                            rollout_id)
            try:
                return await group.train(rollout_id, samples)
            except RankFailure as failure:
                if len(group.ranks) == group.world_size and _generation(group) == self._rank_generation:
                    raise  # every rank is still there: not a rank death that a restart can mend
                log.warning("train step of rollout %d failed: %s", rollout_id, failure.reason)
                # the loop head sees the missing or restarted ranks and recovers them

    async def save(self, rollout_id: int) -> None:
        assert self.trainer is not None
        extra = {"rollout_id": rollout_id, "weight_version": self.weight_version,
                 "rollout_state": self.rollouts.state_dict()}
        path = await self.trainer.save(rollout_id, extra)
        log.info("saved checkpoint of rollout %d to %s", rollout_id, path)


def _generation(group: Any) -> dict[int, int]:
    return {rank: info.restart_count for rank, info in group.ranks.items()}


async def recover_train_group(group: Any, *, failed_generation: int, timeout: float = 300.0) -> Any:
    """Train FT, after a RankFailure: wait until torchrun's restart brought every rank back (each reports a
    restart count above the failed generation's), initialise them again with the same train config, and load
    the last checkpoint of the save dir when there is one (else they start from the initial model).
    Returns the CheckpointInfo loaded, or None.
    """
    from coordinator.train_group import RankFailure

    try:
        with anyio.fail_after(timeout):
            while True:
                await group.wait_for_ranks(restarted_after=failed_generation)
                try:
                    await group.init(group.train_config)
                    break
                except RankFailure:
                    # A rank of the old generation was still listed, or the new one failed again: wait for the
                    # group to change rather than spin on a call that fails at once.
                    await anyio.sleep(0.1)
    except TimeoutError:
        missing = sorted(set(range(group.world_size)) - set(group.ranks))
        raise RankFailure(missing, f"train FT: the ranks did not all come back within {timeout:.0f}s "
                                   "(torchrun out of --max-restarts?)") from None
    save_dir = (group.train_config or {}).get("save_dir")
    if save_dir and await anyio.Path(save_dir, "latest").exists():
        return await group.load_checkpoint(save_dir)
    return None


def _summary(rollout_id: int, total: int, record: dict[str, Any]) -> str:
    parts = [f"rollout {rollout_id + 1}/{total}"]
    for key, label, fmt in (("rollout/reward_mean", "reward", "{:.3f}"), ("train/loss", "loss", "{:.4f}"),
                            ("train/train_rollout_logprob_abs_diff_max", "logp diff", "{:.1e}"),
                            ("rollout/time_s", "gen", "{:.1f}s"), ("train/time_s", "train", "{:.1f}s"),
                            ("sync/time_s", "sync", "{:.2f}s")):
        if key in record:
            parts.append(f"{label} {fmt.format(record[key])}")
    return "  ".join(parts)
