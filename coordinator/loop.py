"""The training loop: resume, rollouts in, train steps, weight syncs and every checkpoint out.

Owns the order of one run: resume from `--load` (the ranks' state, the data order, the restored weights pushed
to the engines), the before-loop phases (slime's evaluation at rollout 0), then for each rollout id a batch from
the rollout source (generated or replayed: the loop cannot tell), a train step, the weight sync and the
interval save, and after the last step the after-loop phases (evaluations still in flight) and the final save.
The schedules (synchronous, one-step-off-policy, colocated) are described in docs/architecture.md.

A stop (`request_stop`, armed for a stop signal by `coordinator.run` when the run saves) abandons the rollout
being generated (its batch is dropped) and any evaluation going on (before the loop or after a step), lets a
train step already sent to the ranks finish (its weight sync too: neither can be taken back half-done), skips
the remaining step hooks and the after-loop phases, saves the last trained rollout unless it is saved already,
and returns with `stopped` set.

Rollouts are numbered by their id, from 0, as slime and miles number them (metrics' `step`, checkpoints'
`rollout_<id>`, dumps' `{rollout_id}`); the log says `rollout <id> (<done> of <total>)`.

Invariants: the weight version names the number of optimizer updates applied to the policy, as a string
("0" = `--hf-checkpoint`), and after the sync of step k every engine reports str(k + 1); with `--save` or
`--save-hf` (a Hugging Face directory at each save, formatted with the rollout id), every rollout id is saved at
most once, and the last trained rollout always is (stopped or not), with the data position right after that
rollout's batch (not a batch generated ahead or abandoned); a save is the coordinator's decision: the checkpoint
of step k is published (`latest` names it) only after step k's metrics row is written, so a resume never skips
a row (a save the ranks finish after the coordinator died stays unpublished).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import msgspec

from coordinator.config import CheckpointConfig, RolloutConfig
from coordinator.config.checkpoint import save_hf_path
from coordinator.observe import timeline
from coordinator.observe.progress import MetricsLog, RunProgress
from replay.sample import RolloutBatch, Sample

log = logging.getLogger("rayless")


def staleness_histogram(samples: Any, version: int) -> dict[str, float]:
    """`rollout/staleness/<k>`: how many of the samples were generated (their first token) with the weights `k`
    versions behind `version`, the policy they train; samples without a numeric version are not counted."""
    counts: dict[int, int] = {}
    for sample in samples:
        first = sample.weight_versions[:1]
        if first and first[0].isdigit():
            behind = max(version - int(first[0]), 0)
            counts[behind] = counts.get(behind, 0) + 1
    return {f"rollout/staleness/{behind}": float(count) for behind, count in sorted(counts.items())}
class SavedProgress(msgspec.Struct):
    """What the loop saves beside the ranks' state (a checkpoint's `extra`), read back typed on a resume."""

    rollout_id: int = -1
    weight_version: str = ""
    #: the rollout source's position right after the trained batch (`RolloutSource.state_dict`)
    rollout_state: dict[str, Any] = msgspec.field(default_factory=dict)


class RolloutSource(Protocol):
    async def get_rollout(self, rollout_id: int, weight_version: str) -> RolloutBatch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Checkpoint(Protocol):
    """What a trainer's `load_checkpoint` returns (rank 0's `workers.protocol.LoadReply`)."""

    @property
    def rollout_id(self) -> int: ...

    @property
    def extra(self) -> dict[str, Any]: ...


class Trainer(Protocol):
    async def train(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]: ...

    async def save(self, rollout_id: int, extra: dict[str, Any], *, publish: bool = True) -> Any: ...

    async def publish(self, rollout_id: int) -> Any: ...

    async def save_hf(self, directory: str) -> Any: ...

    async def load_checkpoint(self, path: Path) -> Checkpoint: ...

    @property
    def recoveries(self) -> int:
        """Times the trainer brought failed ranks back and resent a step (train FT)."""
        ...


class Syncer(Protocol):
    async def update(self, version: str) -> dict[str, float]: ...


class Swap(Protocol):
    """The memory hand-over of a colocated step (`coordinator.weights.colocate.Colocation`)."""

    async def before_train(self, rollout_id: int, generate_s: float) -> dict[str, float]: ...

    async def during_train(self) -> None: ...

    async def after_train(self, rollout_id: int, version: str, train_s: float) -> dict[str, float]: ...

    async def after_update(self) -> dict[str, float]: ...


class StepHook(Protocol):
    async def after_step(self, rollout_id: int, weight_version: str) -> None: ...


class LoopPhase(Protocol):
    """Work around the whole loop: `before_loop` once resume is done, `after_loop` before the final save."""

    async def before_loop(self, start_rollout: int, weight_version: str) -> None: ...

    async def after_loop(self) -> None: ...


@dataclass
class LoopResult:
    rollouts: int = 0
    train_steps: int = 0
    start_rollout: int = 0
    #: rollout ids saved, in order (each at most once)
    saved: list[int] = field(default_factory=list)
    #: the loop ended early on `request_stop`
    stopped: bool = False
    #: the newest checkpoint a resume would load: the last one saved, else the one resumed from
    checkpoint: Path | None = None


@dataclass(kw_only=True, eq=False, repr=False)
class TrainingLoop:
    rollout: RolloutConfig
    checkpoint: CheckpointConfig
    rollouts: RolloutSource
    trainer: Trainer | None
    weight_sync: Syncer | None
    metrics: MetricsLog
    num_rollout: int
    #: a checkpoint to resume from (`--load` resolved); only with a trainer
    resume_from: Path | None = None
    hooks: list[StepHook] = field(default_factory=list)
    phases: list[LoopPhase] = field(default_factory=list)
    #: rollouts done and the ETA, for the run-level bar (`coordinator.observe.progress`)
    progress: RunProgress = field(default_factory=RunProgress)
    colocation: Swap | None = None
    start_rollout: int = field(default=0, init=False)
    version: int = field(default=0, init=False)  # optimizer updates applied so far
    _version_changed: anyio.Event = field(default_factory=anyio.Event, init=False)
    _result: LoopResult = field(default_factory=LoopResult, init=False)
    #: set by `request_stop`; `_abandon` is the scope of the generation going on, which a stop cancels
    _stopping: bool = field(default=False, init=False)
    _abandon: anyio.CancelScope | None = field(default=None, init=False)
    #: the last rollout trained, and the rollout source's state right after its batch (what a save records)
    _last_trained: int | None = field(default=None, init=False)
    _trained_state: dict[str, Any] = field(default_factory=dict, init=False)

    @property
    def weight_version(self) -> str:
        return str(self.version)

    @property
    def train_recoveries(self) -> int:
        return self.trainer.recoveries if self.trainer is not None else 0

    @property
    def saves(self) -> bool:
        """Whether this loop saves (`--save` checkpoints, `--save-hf` directories) and has training ranks."""
        return bool(self.checkpoint.saves and self.trainer is not None)

    def request_stop(self, reason: object = None) -> str:
        """End the run cleanly and soon (a stop signal): see the module docstring. Returns what happens now."""
        self._stopping = True
        if self._abandon is not None:
            self._abandon.cancel()
        self._version_changed.set()  # a producer waiting for the policy to catch up wakes, and ends
        if self.saves:
            return "abandoning the rollout being generated, finishing a train step in flight, then saving"
        return "abandoning the rollout being generated, finishing a train step in flight"

    async def run(self) -> LoopResult:
        result = self._result
        await self._resume()
        result.start_rollout = self.start_rollout
        if self.start_rollout > 0:
            # a resume redoes every step from start_rollout: an earlier run's rows for them are replaced
            self.metrics.resume_at(self.start_rollout)
        for phase in self.phases:
            with self._abandonable():  # an evaluation before the first step: nothing to save if stopped
                await phase.before_loop(self.start_rollout, self.weight_version)
        self.progress.begin(self.start_rollout, self.num_rollout)
        if self.rollout.async_rollout and self.trainer is not None:
            await self._run_async(result)
        else:
            for rollout_id in range(self.start_rollout, self.num_rollout):
                started = time.monotonic()
                timeline.at_step(rollout_id, self.weight_version)
                generated = await self._generate(rollout_id)
                if generated is None:
                    break
                await self._train_and_sync(*generated, result, started)
                if self._stopping:
                    break
        result.stopped = self._stopping
        if not self._stopping:
            for phase in self.phases:
                await phase.after_loop()
        last = self._last_trained
        if self.saves and last is not None and last not in result.saved:
            await self.save(last)
        return result

    async def _generate(self, rollout_id: int) -> tuple[RolloutBatch, dict[str, Any]] | None:
        """Rollout `rollout_id` and the source's state right after it; None once a stop abandoned it."""
        if self._stopping:
            return None
        with self._abandonable(), timeline.span("generate"):
            batch = await self.rollouts.get_rollout(rollout_id, self.weight_version)
            return batch, self.rollouts.state_dict()
        log.info("rollout %d abandoned: the run is stopping", rollout_id)
        return None

    @contextmanager
    def _abandonable(self) -> Iterator[None]:
        """A generation a stop may abandon (a cancel scope is entered once: a new one each time)."""
        with anyio.CancelScope() as scope:
            self._abandon = scope
            try:
                yield
            finally:
                self._abandon = None

    async def _resume(self) -> None:
        """With a checkpoint to resume from: the ranks' state, the data order, the restored weights pushed."""
        if self.resume_from is None or self.trainer is None:
            return
        checkpoint = await self.trainer.load_checkpoint(self.resume_from)
        self._result.checkpoint = self.resume_from
        self.start_rollout = checkpoint.rollout_id + 1
        self.version = self.start_rollout
        self._trained_state = msgspec.convert(checkpoint.extra, SavedProgress).rollout_state
        self.rollouts.load_state_dict(self._trained_state)
        log.info("resumed from %s (the checkpoint of rollout %d): continuing at rollout %d", self.resume_from,
                 checkpoint.rollout_id, self.start_rollout)
        if self.weight_sync is not None:
            await self.weight_sync.update(self.weight_version)

    async def _run_async(self, result: LoopResult) -> None:
        send, receive = anyio.create_memory_object_stream[tuple[RolloutBatch, dict[str, Any], float]](
            max_buffer_size=0)
        staleness = self.rollout.max_weight_staleness

        async def produce() -> None:
            async with send:
                for rollout_id in range(self.start_rollout, self.num_rollout):
                    while self.version < rollout_id - staleness and not self._stopping:
                        await self._version_changed.wait()
                    if self._stopping:
                        return
                    started = time.monotonic()
                    with self._abandonable(), timeline.span("generate", ("rollout", "generate ahead"),
                                                      rollout_id=rollout_id):
                        batch = await self.rollouts.get_rollout(rollout_id, self.weight_version)
                        await send.send((batch, self.rollouts.state_dict(), started))

        async with anyio.create_task_group() as group:
            group.start_soon(produce)
            async with receive:
                async for batch, state, started in receive:
                    histogram = staleness_histogram(batch.samples, self.version)
                    behind = max((int(key.rsplit("/", 1)[1]) for key in histogram), default=0)
                    if behind > staleness:
                        raise RuntimeError(
                            f"rollout {batch.rollout_id} holds samples from weight version {self.version - behind}, "
                            f"{behind} behind the policy; --max-weight-staleness is {staleness}"
                        )
                    batch.metrics.update(histogram)
                    await self._train_and_sync(batch, state, result, started)
                    if self._stopping:
                        group.cancel_scope.cancel()  # the producer may wait on the version, not generating
                        break

    async def _train_and_sync(self, batch: RolloutBatch, state: dict[str, Any], result: LoopResult,
                              started: float) -> None:
        """Train on `batch` (`state`: the rollout source's state right after it) and push the new weights."""
        rollout_id = batch.rollout_id
        record: dict[str, Any] = dict(batch.metrics)
        record["rollout/samples"] = float(len(batch.samples))
        rewards = [s.scalar_reward(self.rollout.reward_key) for s in batch.samples if s.reward is not None]
        if rewards and "rollout/reward_mean" not in record:
            record["rollout/reward_mean"] = sum(rewards) / len(rewards)
        result.rollouts += 1
        if self.trainer is not None:
            swap = self.colocation
            timeline.at_step(rollout_id, self.weight_version)
            if swap is not None:
                with timeline.span("colocation swap"):
                    record.update(await swap.before_train(rollout_id, time.monotonic() - started))
            train_started = time.monotonic()
            async with anyio.create_task_group() as beside:
                if swap is not None:
                    beside.start_soon(swap.during_train)
                with timeline.span("train"):
                    train_metrics = await self.trainer.train(rollout_id, batch.samples)
            record.update({key if key.startswith("train/") else f"train/{key}": value
                           for key, value in train_metrics.items()})
            record["train/time_s"] = time.monotonic() - train_started
            result.train_steps += 1
            self._last_trained, self._trained_state = rollout_id, state
            self.version += 1
            self._version_changed.set()
            self._version_changed = anyio.Event()
            interval = self.checkpoint.save_interval
            save_due = bool(self.saves and interval and (rollout_id + 1) % interval == 0)
            if swap is not None:
                if save_due:  # while the ranks still hold their state on the device
                    await self.save(rollout_id, publish=False)
                    save_due = False
                with timeline.span("colocation swap"):
                    record.update(await swap.after_train(rollout_id, self.weight_version, record["train/time_s"]))
            if self.weight_sync is not None:
                with timeline.span("weight sync", version=self.weight_version):
                    record.update(await self.weight_sync.update(self.weight_version))
            if swap is not None:
                with timeline.span("colocation swap"):
                    record.update(await swap.after_update())
            if save_due:
                await self.save(rollout_id, publish=False)
        record["weight_version"] = self.weight_version
        record["step/time_s"] = time.monotonic() - started
        self.metrics.log(rollout_id, record)
        if rollout_id in result.saved and self.checkpoint.save:
            # the row is written: only now may a resume start after this step
            with timeline.span("save"):
                path = await self.trainer.publish(rollout_id)  # type: ignore[union-attr]
            log.info("saved checkpoint of rollout %d to %s", rollout_id, path)
        await timeline.step_done(rollout_id, started, record["step/time_s"])
        self.progress.rollout_done(rollout_id)
        log.info("%s  %s", _summary(rollout_id, self.num_rollout, record), self.progress.timing_text())
        for hook in self.hooks:
            if self._stopping:
                return  # evaluations wait for the resumed run
            with self._abandonable():  # the step is trained and counted: an evaluation after it may be cut short
                await hook.after_step(rollout_id, self.weight_version)

    async def save(self, rollout_id: int, *, publish: bool = True) -> None:
        """Save the last trained rollout, `rollout_id`, with the data position right after its batch; with
        `publish=False` the checkpoint waits for `trainer.publish` (the step's metrics row first)."""
        assert self.trainer is not None and rollout_id == self._last_trained, (rollout_id, self._last_trained)
        extra = msgspec.to_builtins(SavedProgress(rollout_id, self.weight_version, self._trained_state))
        with timeline.span("save"):
            if self.checkpoint.save:
                path = await self.trainer.save(rollout_id, extra, publish=publish)
                if publish:  # else said once published, where it then lies (`rollout_<id>`, not `tmp-<id>`)
                    log.info("saved checkpoint of rollout %d to %s", rollout_id, path)
            if self.checkpoint.save_hf:
                path = await self.trainer.save_hf(save_hf_path(self.checkpoint.save_hf, rollout_id))
                log.info("saved the model of rollout %d as a Hugging Face directory: %s", rollout_id, path)
        self._result.saved.append(rollout_id)
        if self.checkpoint.save:
            self._result.checkpoint = Path(self.checkpoint.save)


def _summary(rollout_id: int, total: int, record: dict[str, Any]) -> str:
    """`rollout 7 (8 of 60)  reward ...`: the rollout's id (from 0, as metrics and checkpoints name it), then the
    count done of the run's total."""
    parts = [f"rollout {rollout_id} ({rollout_id + 1} of {total})"]
    for key, label, fmt in (("rollout/reward_mean", "reward", "{:.3f}"), ("train/loss", "loss", "{:.4f}"),
                            ("train/train_rollout_logprob_abs_diff_max", "logp diff", "{:.1e}"),
                            ("rollout/time_s", "gen", "{:.1f}s"), ("train/time_s", "train", "{:.1f}s"),
                            ("sync/time_s", "sync", "{:.2f}s"), ("colocate/swap_s", "swap", "{:.2f}s")):
        if key in record:
            parts.append(f"{label} {fmt.format(record[key])}")
    return "  ".join(parts)
