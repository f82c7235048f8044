"""The command API of a `TrainGroup`: each command the training ranks serve, as one method.

Owns turning a call (init, train, save, load, weight export and broadcast, offload / onload) into the
protocol's command for every rank and the ranks' answers into one result: rank 0's, or the ranks' reduced
(`planning`, `state_moves`). Invariants: every command goes through the control server's one call lock, so
all ranks see the same commands in the same order; with train FT, a step or a state move lost to dead ranks
is sent again only once they are back (`recovery`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.observe.startup import PhaseObserver
from coordinator.observe.timeline import ranks_trained
from coordinator.train.channel import ControlServer
from coordinator.train.planning import (
    StepPlan,
    plan_steps,
    reduce_rollout_metrics,
    reduce_step_metrics,
)
from coordinator.train.recovery import RankRecovery
from workers import protocol
from workers.protocol.train_settings import TrainSettings

if TYPE_CHECKING:
    from workers.train_rank.checkpoint import LoadedCheckpoint


def state_moves(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One offload/onload over the ranks: the slowest rank's seconds, the state's bytes summed, every memory
    figure (bytes) as the largest rank's, and each rank's digest when asked (`digests`)."""
    summary: dict[str, Any] = {"seconds": max(float(r.get("seconds", 0.0)) for r in per_rank),
                               "state_bytes": sum(int(r.get("state_bytes", 0)) for r in per_rank)}
    for key in sorted({k for r in per_rank for k in r if k.endswith("_bytes") and k != "state_bytes"}):
        summary[key] = max(int(r.get(key, 0)) for r in per_rank)
    if any("digest" in r for r in per_rank):
        summary["digests"] = [r.get("digest") for r in per_rank]
    return summary


class TrainCommands:
    """The commands of a group whose ranks are connected to `server` (`TrainGroup` sets what is declared)."""

    NAME = "train-ranks"

    server: ControlServer
    world_size: int
    observer: PhaseObserver
    recovery: RankRecovery | None
    settings: TrainSettings | None
    #: one dict of metrics per optimizer step of the last `train()`
    step_metrics: list[dict[str, float]]
    #: each rank's seconds in the last `train()` (the sum of its steps' `step_time_s`; the status server's)
    rank_step_s: tuple[float, ...] = ()

    async def init(self, settings: TrainSettings) -> dict[str, Any]:
        """Load the model on every rank and build the optimizer. Returns rank 0's summary."""
        self.observer.phase(self.NAME, "loading", "model and optimizer on every rank")
        results = await self.server.call_all(protocol.InitCommand(settings))
        self.settings = settings
        self.observer.phase(self.NAME, "ready")
        if self.recovery is not None:
            self.recovery.initialised()
        return results[0]

    async def train(self, rollout_id: int, samples: Sequence[Any]) -> dict[str, float]:
        """Train on one rollout's samples (`replay.sample.Sample`s with advantages set).

        The samples are cut into optimizer steps in order (`global_batch_size` samples each, or
        `num_steps_per_rollout` equal steps, else one step); each step is split across ranks balanced
        by token count. Returns the rollout's metrics; `step_metrics` keeps one dict per step. With train FT
        (`max_restarts > 0`) a step lost to dead ranks is sent again once they are back (`recovery`).
        """
        if self.settings is None:
            raise RuntimeError("TrainGroup.train() before init(): call init(settings) first")
        if self.recovery is None:
            return await self._train_once(rollout_id, samples)
        return await self.recovery.run_step(rollout_id, lambda: self._train_once(rollout_id, samples))

    async def _train_once(self, rollout_id: int, samples: Sequence[Any]) -> dict[str, float]:
        assert self.settings is not None  # train() checked
        batching = self.settings.batching

        def prepare() -> list[StepPlan]:
            # Converting and splitting thousands of samples would stall the event loop.
            wire = [protocol.WireSample.from_sample(sample) for sample in samples]
            return plan_steps(wire, batching, self.world_size)

        plan = await anyio.to_thread.run_sync(prepare)
        commands: dict[int, protocol.Command] = {
            rank: protocol.TrainCommand(
                rollout_id=int(rollout_id),
                steps=[step.shards[rank] for step in plan],
                step_loss_tokens=[step.loss_tokens for step in plan],
            )
            for rank in range(self.world_size)
        }
        results = await self.server.call(commands)
        by_rank = [protocol.TrainResult.from_wire(results[rank]).steps for rank in range(self.world_size)]
        step_times = [[step.step_time_s for step in steps] for steps in by_rank]
        self.rank_step_s = tuple(sum(times) for times in step_times)
        ranks_trained(step_times, rollout_id)
        self.step_metrics = [
            reduce_step_metrics([steps[index] for steps in by_rank]) for index in range(len(plan))
        ]
        return reduce_rollout_metrics(self.step_metrics)

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
        return Path((await self.server.call_all(command))[0]["path"])

    async def publish(self, rollout_id: int, directory: str | Path | None = None) -> Path:
        """Publish the checkpoint `save(publish=False)` wrote: `latest` names it from now on."""
        command = protocol.PublishCommand(rollout_id=int(rollout_id), directory=self._save_dir(directory))
        return Path((await self.server.call_all(command))[0]["path"])

    def _save_dir(self, directory: str | Path | None) -> str:
        target = directory or (self.settings.checkpoint.save_dir if self.settings is not None else None)
        if not target:
            raise ValueError(
                "save() needs a directory: pass directory= or set checkpoint.save_dir in the settings"
            )
        return str(target)

    async def save_hf(self, directory: str | Path) -> Path:
        """Write the model as a Hugging Face directory at `directory` (`--save-hf`; rank 0 writes)."""
        return Path((await self.server.call_all(protocol.SaveHfCommand(directory=str(directory))))[0]["path"])

    async def load_checkpoint(self, path: str | Path) -> LoadedCheckpoint:
        """Restore a checkpoint (a save dir → its `latest`, or a `rollout_<id>` dir) on every rank. A broken
        `latest` is refused (the ranks answer a CheckpointError listing the complete checkpoints)."""
        from workers.train_rank.checkpoint import (
            LoadedCheckpoint,  # the rank's own record (torch: imported late)
        )

        first = (await self.server.call_all(protocol.LoadCommand(str(path))))[0]
        info = LoadedCheckpoint(
            rollout_id=int(first["rollout_id"]), extra=dict(first["extra"]), path=Path(first["path"]),
        )
        return info

    async def load(self, path: str | Path) -> int:
        """Restore a checkpoint; returns the rollout id it was saved at (resume at that id + 1)."""
        return (await self.load_checkpoint(path)).rollout_id

    async def export_weights(self, directory: str | Path, weight_version: str | int, keep: int = 2) -> Path:
        """Rank 0 writes `<directory>/weights-<version>` (HF safetensors + config/tokenizer); keeps the last `keep`."""
        command = protocol.ExportWeightsCommand(
            directory=str(directory), weight_version=str(weight_version), keep=keep
        )
        return Path((await self.server.call_all(command))[0]["path"])

    async def export_weight_delta(self, directory: str | Path, weight_version: str, *, base_version: str,
                                  encoding: str, keep: int = 2) -> dict[str, Any]:
        """`--update-weight-mode delta`: rank 0 writes `<directory>/delta-<version>` (the tensors changed since
        its copy of `base_version`'s weights) or, holding no such copy, a full `weights-<version>`; answered with
        `path`, `delta` (which of the two) and `changed` (the names written)."""
        command = protocol.ExportWeightsCommand(
            directory=str(directory), weight_version=str(weight_version), keep=keep,
            delta_encoding=encoding, delta_base_version=str(base_version),
        )
        return dict((await self.server.call_all(command))[0])

    async def weight_manifest(self) -> list[tuple[str, str, list[int]]]:
        """(name, dtype, shape) of every tensor a distributed update sends (parameter metadata, no gather)."""
        results = await self.server.call_all(protocol.WeightManifestCommand())
        return [(name, dtype, list(shape)) for name, dtype, shape in results[0]["manifest"]]

    async def weight_buckets(
        self, bucket_bytes: int = protocol.BroadcastWeightsCommand.bucket_bytes
    ) -> list[list[tuple[str, str, list[int]]]]:
        """Per bucket of at most `bucket_bytes`, (name, dtype, shape) of each tensor in send order: what
        `broadcast_weights` with the same `bucket_bytes` sends, one request's worth per bucket."""
        results = await self.server.call_all(protocol.WeightManifestCommand(bucket_bytes=int(bucket_bytes)))
        return [[(name, dtype, list(shape)) for name, dtype, shape in bucket] for bucket in results[0]["buckets"]]

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
    ) -> dict[str, Any]:
        """Rank 0 joins the weight-update group as rank 0 (within `timeout_s`) and sends `weight_buckets(
        bucket_bytes)` bucket by bucket; under FSDP every rank gathers each bucket with it.

        Returns rank 0's report {"ok", "joined", "error", "buckets", "bytes", "seconds"}: a group that did not
        form or a
        send that failed is reported there (the training group stays usable), not raised. Meanwhile the caller
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
        return (await self.server.call_all(command))[0]

    async def offload(self, rollout_id: int = -1, *, verify: bool = False) -> dict[str, Any]:
        """Every rank moves its training state off the device (colocation: `workers.train_rank.offload`).
        Returns `state_moves`' summary; with train FT, ranks lost meanwhile are recovered first (train FT's
        rules: restarted, initialised, the last checkpoint loaded) and the command is sent again."""
        return await self._move_state(protocol.OffloadCommand(verify=verify), rollout_id)

    async def onload(self, rollout_id: int = -1, *, verify: bool = False) -> dict[str, Any]:
        """Every rank brings its state back onto the device, bit-identical; as `offload` otherwise."""
        return await self._move_state(protocol.OnloadCommand(verify=verify), rollout_id)

    async def _move_state(self, command: protocol.Command, rollout_id: int) -> dict[str, Any]:
        async def once() -> dict[str, Any]:
            results = await self.server.call_all(command)
            return state_moves([results[rank] for rank in range(self.world_size)])

        if self.recovery is None:
            return await once()
        return await self.recovery.run_step(rollout_id, once)

    async def destroy_weight_group(self, group_name: str = "weight_update_group") -> bool:
        results = await self.server.call({0: protocol.DestroyWeightGroupCommand(group_name)})
        return bool(results[0]["destroyed"])
