"""Train FT: a step that failed because ranks died is sent again once torchrun has restarted them.

Owns the generation of the ranks that hold the model (each rank's process, node and pid, when `init` last
succeeded: a restart count alone does not tell generations apart on several nodes, where torchrun restarts the
surviving nodes' ranks for a membership change without counting it) and the count of recoveries. Before a step, and after a step failed with `RankFailure`, ranks that are missing
or were restarted since (torchrun's `--max-restarts`) hold no model: they are waited for, initialised again
with the same train config and given the last checkpoint of the save dir (else the initial model), then the
step is sent again — at most `max_recoveries` times in a run. A `RankFailure` while every rank of the
initialised generation is still there is not a death a restart can mend: it is raised as is.

Invariant: a step is only ever sent to ranks of the generation that was last initialised.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path
from typing import Protocol, TypeVar

import anyio

from coordinator.train.connection import RankInfo
from coordinator.train.errors import RankFailure
from workers import protocol
from workers.protocol.train_settings import TrainSettings

# The run's narrative logger: these lines belong beside the loop's step lines.
log = logging.getLogger("rayless")

T = TypeVar("T")


class LoadedCheckpoint(Protocol):
    """What the group's `load_checkpoint` answers (`workers.protocol.LoadReply`): where it loaded from."""

    @property
    def path(self) -> str: ...


class RestartableGroup(Protocol):
    """What recovery needs of the ranks it serves (`coordinator.train.commands.TrainCommands`)."""

    world_size: int
    settings: TrainSettings | None

    @property
    def ranks(self) -> dict[int, RankInfo]: ...

    async def wait_for_ranks(self, *, replacing: Collection[tuple[int, int]] = ()) -> dict[int, RankInfo]: ...

    async def init(self, settings: TrainSettings) -> protocol.InitReply: ...

    async def load_checkpoint(self, path: str | Path) -> LoadedCheckpoint: ...


class RankRecovery:
    """Brings a group's restarted ranks back before a step is sent (again)."""

    def __init__(self, group: RestartableGroup, *, max_recoveries: int, timeout_s: float = 300.0) -> None:
        self.group = group
        self.max_recoveries = max_recoveries
        self.timeout_s = timeout_s
        self.recoveries = 0
        self._generation: dict[int, tuple[int, int]] | None = None

    def _current_generation(self) -> dict[int, tuple[int, int]]:
        return {rank: info.process for rank, info in self.group.ranks.items()}

    def initialised(self) -> None:
        """Every rank now holds the model (`init` succeeded): remember their generation."""
        self._generation = self._current_generation()

    @property
    def needed(self) -> bool:
        """Are ranks missing, or restarted since the last `init` (so holding no model)?"""
        if self._generation is None:
            return False
        ranks = self.group.ranks
        return len(ranks) < self.group.world_size or self._current_generation() != self._generation

    async def run_step(self, rollout_id: int, step: Callable[[], Awaitable[T]]) -> T:
        """`step()`, after recovering the ranks when needed, and again after a rank death it can mend."""
        while True:
            # torchrun may have restarted the ranks while we generated: they are back but hold no model yet.
            if self.needed:
                await self._recover_before(rollout_id)
            try:
                return await step()
            except RankFailure as failure:
                if not self.needed:
                    raise  # every rank is still there: not a rank death that a restart can mend
                log.warning("train step of rollout %d failed: %s", rollout_id, failure.reason)
                # the loop head sees the missing or restarted ranks and recovers them

    async def _recover_before(self, rollout_id: int) -> None:
        if self.recoveries >= self.max_recoveries:
            missing = sorted(set(range(self.group.world_size)) - set(self.group.ranks))
            raise RankFailure(
                missing, f"train FT gave up after {self.recoveries} recoveries (--max-restarts)"
            )
        self.recoveries += 1
        log.warning(
            "train FT: ranks failed before rollout %d's step; waiting for the restarted ranks "
            "(recovery %d of at most %d)",
            rollout_id,
            self.recoveries,
            self.max_recoveries,
        )
        loaded = await self.recover()
        log.warning(
            "train FT: ranks are back%s; sending rollout %d's step",
            f" from checkpoint {loaded.path}" if loaded is not None else " from the initial model",
            rollout_id,
        )

    async def recover(self) -> LoadedCheckpoint | None:
        """Wait until torchrun's restart brought every rank back (each a process other than those of the
        failed generation), initialise them again with the same train config, and load the last checkpoint
        of the save dir when there is one. Returns the checkpoint loaded, or None (the initial model)."""
        group = self.group
        failed_generation = set((self._generation or {}).values())
        config = group.settings
        if config is None:
            raise RuntimeError("train FT recovery before init(): nothing to initialise the ranks with")
        try:
            with anyio.fail_after(self.timeout_s):
                while True:
                    await group.wait_for_ranks(replacing=failed_generation)
                    try:
                        await group.init(config)
                        break
                    except RankFailure:
                        # A rank of the old generation was still listed, or the new one failed again: wait
                        # for the group to change rather than spin on a call that fails at once.
                        await anyio.sleep(0.1)
        except TimeoutError:
            missing = sorted(set(range(group.world_size)) - set(group.ranks))
            raise RankFailure(
                missing,
                f"train FT: the ranks did not all come back within {self.timeout_s:.0f}s "
                "(torchrun out of --max-restarts?)",
            ) from None
        save_dir = config.checkpoint.save_dir
        if save_dir and await anyio.Path(save_dir, "latest").exists():
            # verified here first, as at start-up: a damaged or crafted checkpoint is refused naming its file
            # (a CheckpointError, exit 2) before any rank reads it
            from workers.train_rank.checkpoint_files import verify_checkpoint
            from workers.train_rank.checkpoint_layout import resolve_checkpoint

            directory = await anyio.to_thread.run_sync(resolve_checkpoint, save_dir)
            await anyio.to_thread.run_sync(verify_checkpoint, directory)
            return await group.load_checkpoint(directory)
        return None
