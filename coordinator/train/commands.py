"""The command API of a `TrainGroup`: each command the training ranks serve, as one method.

Owns turning a call (init, train, save, load, weight export and broadcast, offload / onload) into the
protocol's command for every rank and the ranks' reply records into one result: rank 0's, or the ranks'
reduced (`planning`, `state_moves`). Invariants: every command goes through the control server's one call lock,
so all ranks see the same commands in the same order, and each rank's reply is the record its command declares
(`workers.protocol.replies`), read by field; with train FT, a step or a state move lost to dead ranks is sent
again only once they are back (`recovery`). Imports no torch (a resume's `load` answers a `LoadReply`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio

from coordinator.observe.startup import NO_OBSERVER, PhaseObserver
from coordinator.observe.timeline import ranks_trained
from coordinator.train.channel import ControlServer
from coordinator.train.connection import RankInfo
from coordinator.train.planning import (
    StepPlan,
    plan_steps,
    reduce_rollout_metrics,
    reduce_step_metrics,
)
from coordinator.train.recovery import RankRecovery
from replay.sample import Sample
from workers import protocol
from workers.protocol.train_settings import TrainSettings

R = TypeVar("R", bound=protocol.Reply)


@dataclass(frozen=True)
class StateMoves:
    """One offload/onload over the ranks: the slowest rank's `seconds`, the state's bytes summed, every memory
    figure (bytes, by the rank's name for it) as the largest rank's, and each rank's digest when asked."""

    seconds: float
    state_bytes: int
    memory: dict[str, int] = field(default_factory=dict)
    digests: tuple[str | None, ...] = ()

    def figures(self) -> dict[str, int]:
        """Every bytes figure by name, `state_bytes` included (the colocation's metrics)."""
        return {"state_bytes": self.state_bytes, **self.memory}


def state_moves(per_rank: Sequence[protocol.StateMoveReply]) -> StateMoves:
    """The ranks' replies to one offload/onload as one `StateMoves`."""
    names = sorted({name for reply in per_rank for name in reply.memory})
    return StateMoves(
        seconds=max(reply.seconds for reply in per_rank),
        state_bytes=sum(reply.state_bytes for reply in per_rank),
        memory={name: max(reply.memory.get(name, 0) for reply in per_rank) for name in names},
        digests=tuple(reply.digest for reply in per_rank) if any(r.digest is not None for r in per_rank) else (),
    )


class TrainCommands:
    """The commands of the ranks connected to `server`: what the loop, the weight sync, the colocation and an
    eval fleet are handed as their trainer (`TrainGroup.commands`; the group owns the ranks' lifetime).

    `max_restarts > 0` is train FT: a step or a state move lost to dead ranks is sent again once they are back
    at the last checkpoint (`recovery`, at most `max_restarts` times). `observer` is told the phases of
    "train-ranks" `init` goes through: loading, ready."""

    NAME = "train-ranks"

    def __init__(self, server: ControlServer, *, observer: PhaseObserver = NO_OBSERVER,
                 max_restarts: int = 0) -> None:
        self.server = server
        self.world_size = server.world_size
        self.observer = observer
        self.recovery = RankRecovery(self, max_recoveries=max_restarts) if max_restarts > 0 else None
        #: what `init` sent (train FT initialises restarted ranks with it again)
        self.settings: TrainSettings | None = None
        #: one dict of metrics per optimizer step of the last `train()`
        self.step_metrics: list[dict[str, float]] = []
        #: each rank's seconds in the last `train()` (the sum of its steps' `step_time_s`; the status server's)
        self.rank_step_s: tuple[float, ...] = ()

    @property
    def ranks(self) -> dict[int, RankInfo]:
        """The ranks connected now."""
        return self.server.ranks

    async def wait_for_ranks(self, *, replacing: Collection[tuple[int, int]] = ()) -> dict[int, RankInfo]:
        """Wait until every rank is connected (see `ControlServer.wait_for_ranks`)."""
        return await self.server.wait_for_ranks(replacing=replacing)

    @property
    def recoveries(self) -> int:
        """Train FT recoveries made so far (0 without train FT)."""
        return self.recovery.recoveries if self.recovery is not None else 0

    async def _ask(self, commands: dict[int, protocol.Command], reply: type[R]) -> dict[int, R]:
        """Each rank's reply, typed: the channel checked that each is its command's record (`Command.reply`)."""
        if any(command.reply is not reply for command in commands.values()):
            raise TypeError(f"{reply.__name__} is not what every one of {sorted(commands)} is answered with")
        return await self.server.call(commands)  # type: ignore[return-value]

    async def _ask_all(self, command: protocol.Command, reply: type[R]) -> dict[int, R]:
        return await self._ask(dict.fromkeys(range(self.world_size), command), reply)

    async def init(self, settings: TrainSettings) -> protocol.InitReply:
        """Load the model on every rank and build the optimizer. Returns rank 0's summary."""
        self.observer.phase(self.NAME, "loading", "model and optimizer on every rank")
        results = await self._ask_all(protocol.InitCommand(settings), protocol.InitReply)
        self.settings = settings
        self.observer.phase(self.NAME, "ready")
        if self.recovery is not None:
            self.recovery.initialised()
        return results[0]

    async def train(self, rollout_id: int, samples: Sequence[Sample]) -> dict[str, float]:
        """Train on one rollout's samples (`replay.sample.Sample`s with advantages set).

        The samples are cut into optimizer steps in order (`global_batch_size` samples each, or
        `num_steps_per_rollout` equal steps, else one step); each step is split across ranks balanced
        by token count. Returns the rollout's metrics; `step_metrics` keeps one dict per step. With train FT
        (`max_restarts > 0`) a step lost to dead ranks is sent again once they are back (`recovery`).
        """
        if self.settings is None:
            raise RuntimeError("train() before init(): call init(settings) first")
        if self.recovery is None:
            return await self._train_once(rollout_id, samples)
        return await self.recovery.run_step(rollout_id, lambda: self._train_once(rollout_id, samples))

    async def _train_once(self, rollout_id: int, samples: Sequence[Sample]) -> dict[str, float]:
        assert self.settings is not None  # train() checked
        batching = self.settings.batching

        def prepare() -> tuple[list[StepPlan], dict[int, protocol.Command]]:
            # Converting and splitting thousands of samples would stall the event loop, and so would digesting
            # the images of each rank's table (seconds for a geo3k-sized rollout). share_images before the split:
            # each distinct buffer is digested once for all ranks' tables, not once per rank that trains on it.
            wire = [protocol.WireSample.from_sample(sample) for sample in samples]
            protocol.share_images(wire)
            plan = plan_steps(wire, batching, self.world_size)
            return plan, {
                rank: protocol.TrainCommand(
                    rollout_id=int(rollout_id),
                    steps=[step.shards[rank] for step in plan],
                    step_loss_tokens=[step.loss_tokens for step in plan],
                )
                for rank in range(self.world_size)
            }

        plan, commands = await anyio.to_thread.run_sync(prepare)
        try:
            results = await self._ask(commands, protocol.TrainResult)
        except protocol.FrameTooLarge as exc:  # refused before any rank got a frame: say what made it large
            raise protocol.FrameTooLarge(f"rollout {rollout_id}: {exc}; {command_sizes(commands)}") from exc
        by_rank = [results[rank].steps for rank in range(self.world_size)]
        step_times = [[step.step_time_s for step in steps] for steps in by_rank]
        self.rank_step_s = tuple(sum(times) for times in step_times)
        ranks_trained(step_times, rollout_id)
        self.step_metrics = [
            reduce_step_metrics([steps[index] for steps in by_rank]) for index in range(len(plan))
        ]
        return reduce_rollout_metrics(self.step_metrics)

    async def forward_backward(self, data: Sequence[protocol.TinkerDatum], loss_fn: str,
                               loss_config: dict[str, float], *, forward_only: bool = False
                               ) -> protocol.ForwardBackwardReply:
        """The Tinker service's forward(/backward): datum i to rank i mod N; the ranks' replies put back in the
        data's order, their losses summed (gradients stay on the ranks until `optim_step`)."""
        shares = {rank: list(data[rank::self.world_size]) for rank in range(self.world_size)}
        commands: dict[int, protocol.Command] = {
            rank: protocol.ForwardBackwardCommand(data=share, loss_fn=loss_fn, loss_config=dict(loss_config),
                                                  forward_only=forward_only)
            for rank, share in shares.items()}
        results = await self._ask(commands, protocol.ForwardBackwardReply)
        merged = protocol.ForwardBackwardReply(
            logprobs=[[] for _ in data], elementwise_loss=[[] for _ in data],
            loss_sum=sum(reply.loss_sum for reply in results.values()),
            seconds=max(reply.seconds for reply in results.values()))
        for rank, reply in results.items():
            for offset, (logprobs, losses) in enumerate(zip(reply.logprobs, reply.elementwise_loss, strict=True)):
                merged.logprobs[rank + offset * self.world_size] = logprobs
                merged.elementwise_loss[rank + offset * self.world_size] = losses
        return merged

    async def optim_step(self, command: protocol.OptimStepCommand) -> protocol.OptimStepReply:
        """One Adam step on every rank with the client's parameters: the gradient norm before clipping, the
        slowest rank's seconds."""
        results = await self._ask_all(command, protocol.OptimStepReply)
        return protocol.OptimStepReply(grad_norm=results[0].grad_norm,
                                       seconds=max(reply.seconds for reply in results.values()))

    async def save(
        self, rollout_id: int, extra: dict[str, Any] | None = None, directory: str | Path | None = None,
        *, publish: bool = True,
    ) -> Path:
        """Write a resumable checkpoint to `<save_dir>/rollout_<id>` (atomic; `latest` updated). With
        `publish=False` it stays in `<save_dir>/tmp-<id>`, complete, until `publish` (the coordinator's
        decision: a save it did not publish is not resumed from)."""
        command = protocol.SaveCommand(
            rollout_id=int(rollout_id), directory=self._save_dir(directory), extra=dict(extra or {}),
            publish=publish,
        )
        return Path((await self._ask_all(command, protocol.SaveReply))[0].path)

    async def publish(self, rollout_id: int, directory: str | Path | None = None) -> Path:
        """Publish the checkpoint `save(publish=False)` wrote: `latest` names it from now on."""
        command = protocol.PublishCommand(rollout_id=int(rollout_id), directory=self._save_dir(directory))
        return Path((await self._ask_all(command, protocol.PublishReply))[0].path)

    def _save_dir(self, directory: str | Path | None) -> str:
        target = directory or (self.settings.checkpoint.save_dir if self.settings is not None else None)
        if not target:
            raise ValueError(
                "save() needs a directory: pass directory= or set checkpoint.save_dir in the settings"
            )
        return str(target)

    async def save_hf(self, directory: str | Path) -> Path:
        """Write the model as a Hugging Face directory at `directory` (`--save-hf`; rank 0 writes)."""
        command = protocol.SaveHfCommand(directory=str(directory))
        return Path((await self._ask_all(command, protocol.SaveHfReply))[0].path)

    async def load_checkpoint(self, path: str | Path, *, weights_only: bool = False) -> protocol.LoadReply:
        """Restore a checkpoint (a save dir → its `latest`, or a `rollout_<id>` dir) on every rank; rank 0's
        `LoadReply` (rollout id, the saved `extra`, the directory). A broken `latest` is refused (the ranks
        answer a CheckpointError listing the complete checkpoints). `weights_only`: a fresh optimizer state."""
        command = protocol.LoadCommand(str(path), weights_only=weights_only)
        return (await self._ask_all(command, protocol.LoadReply))[0]

    async def load(self, path: str | Path) -> int:
        """Restore a checkpoint; returns the rollout id it was saved at (resume at that id + 1)."""
        return (await self.load_checkpoint(path)).rollout_id

    async def export_weights(self, directory: str | Path, weight_version: str | int, keep: int = 2) -> Path:
        """Rank 0 writes `<directory>/weights-<version>` (HF safetensors + config/tokenizer); keeps the last `keep`."""
        command = protocol.ExportWeightsCommand(
            directory=str(directory), weight_version=str(weight_version), keep=keep
        )
        return Path((await self._ask_all(command, protocol.ExportWeightsReply))[0].path)

    async def export_weight_delta(self, directory: str | Path, weight_version: str, *, base_version: str,
                                  encoding: str, keep: int = 2) -> protocol.ExportWeightsReply:
        """`--update-weight-mode delta`: rank 0 writes `<directory>/delta-<version>` (the tensors changed since
        its copy of `base_version`'s weights) or, holding no such copy, a full `weights-<version>`; its reply
        says which (`delta`), where (`path`) and the names written (`changed`)."""
        command = protocol.ExportWeightsCommand(
            directory=str(directory), weight_version=str(weight_version), keep=keep,
            delta_encoding=encoding, delta_base_version=str(base_version),
        )
        return (await self._ask_all(command, protocol.ExportWeightsReply))[0]

    async def weight_manifest(self) -> list[protocol.TensorMeta]:
        """(name, dtype, shape) of every tensor a distributed update sends (parameter metadata, no gather)."""
        return (await self._ask_all(protocol.WeightManifestCommand(), protocol.WeightManifestReply))[0].manifest

    async def weight_buckets(
        self, bucket_bytes: int = protocol.BroadcastWeightsCommand.bucket_bytes
    ) -> list[list[protocol.TensorMeta]]:
        """Per bucket of at most `bucket_bytes`, (name, dtype, shape) of each tensor in send order: what
        `broadcast_weights` with the same `bucket_bytes` sends, one request's worth per bucket."""
        command = protocol.WeightManifestCommand(bucket_bytes=int(bucket_bytes))
        return (await self._ask_all(command, protocol.WeightManifestReply))[0].buckets

    async def broadcast_weights(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = "weight_update_group",
        timeout_s: float = 120.0,
        *,
        backend: str = "gloo",
        bucket_bytes: int = protocol.BroadcastWeightsCommand.bucket_bytes,
        load_format: str | None = None,
    ) -> protocol.BroadcastWeightsReply:
        """Rank 0 joins the weight-update group as rank 0 (within `timeout_s`) and sends `weight_buckets(
        bucket_bytes)` bucket by bucket; under FSDP every rank gathers each bucket with it.

        Returns rank 0's report (`BroadcastWeightsReply`): a group that did not form or a send that failed is
        reported there (the training group stays usable), not raised. Meanwhile the caller
        posts `/init_weights_update_group`, then per bucket `/update_weights_from_distributed`, to the engines.
        """
        command = protocol.BroadcastWeightsCommand(
            master_address=master_address,
            master_port=int(master_port),
            world_size=int(world_size),
            group_name=group_name,
            timeout_s=float(timeout_s),
            backend=backend,
            bucket_bytes=int(bucket_bytes),
            load_format=load_format or "",
        )
        return (await self._ask_all(command, protocol.BroadcastWeightsReply))[0]

    async def offload(self, rollout_id: int = -1, *, verify: bool = False) -> StateMoves:
        """Every rank moves its training state off the device (colocation: `workers.train_rank.offload`).
        Returns `state_moves`' summary; with train FT, ranks lost meanwhile are recovered first (train FT's
        rules: restarted, initialised, the last checkpoint loaded) and the command is sent again."""
        return await self._move_state(protocol.OffloadCommand(verify=verify), rollout_id)

    async def onload(self, rollout_id: int = -1, *, verify: bool = False) -> StateMoves:
        """Every rank brings its state back onto the device, bit-identical; as `offload` otherwise."""
        return await self._move_state(protocol.OnloadCommand(verify=verify), rollout_id)

    async def _move_state(self, command: protocol.Command, rollout_id: int) -> StateMoves:
        async def once() -> StateMoves:
            results = await self._ask_all(command, command.reply)
            return state_moves([results[rank] for rank in range(self.world_size)])  # type: ignore[misc]

        if self.recovery is None:
            return await once()
        return await self.recovery.run_step(rollout_id, once)

    async def destroy_weight_group(self, group_name: str = "weight_update_group") -> bool:
        results = await self._ask({0: protocol.DestroyWeightGroupCommand(group_name)}, protocol.DestroyWeightGroupReply)
        return results[0].destroyed


def command_sizes(commands: dict[int, protocol.Command]) -> str:
    """What each rank's train command carries (samples, tokens, distinct images and their pixel bytes), and what
    to change when it is over the control channel's frame limit."""
    parts = []
    for rank, command in sorted(commands.items()):
        assert isinstance(command, protocol.TrainCommand)
        samples = [sample for step in command.steps for sample in step]
        tokens = sum(len(sample.tokens) for sample in samples)
        with_images = sum(sample.image_ref != -1 for sample in samples)
        parts.append(f"rank {rank}: {len(samples)} samples, {tokens} tokens"
                     + (f", {len(command.images)} distinct image set(s) for {with_images} samples = "
                        f"{command.image_bytes() / 2**20:.1f} MiB of float32 pixel values" if command.images else ""))
    return ("; ".join(parts) + f". Raise {protocol.ENV_MAX_FRAME} (read by the coordinator and its ranks), or send "
            "less per rollout: fewer prompts (--rollout-batch-size), more training ranks, or smaller images (the "
            "processor's max_pixels in --hf-checkpoint's preprocessor_config.json)")
