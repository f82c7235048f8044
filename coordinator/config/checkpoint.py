"""The checkpoint slice: where training checkpoints go and come from, and the engines' weight snapshots.

Owns these flags. Invariant: a save interval has a directory to save to.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config.fields import ConfigError, Slice, flag


@dataclass(frozen=True)
class CheckpointConfig(Slice):
    TITLE = "checkpoint"
    DESCRIPTION = "training checkpoints and weight snapshots"

    save: str | None = flag(None, help="checkpoint directory", metavar="DIR")
    load: str | None = flag(None, help="resume from this checkpoint directory", metavar="DIR")
    save_interval: int | None = flag(None, help="save every K rollouts", minimum=1)
    keep_weight_snapshots: int = flag(2, help="weight snapshots for engines kept on disk", minimum=1)

    def check(self) -> None:
        if self.save_interval is not None and self.save is None:
            raise ConfigError("--save-interval needs --save DIR")
