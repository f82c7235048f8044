"""The checkpoint slice: where training checkpoints go and come from, and the engines' weight snapshots.

Owns these flags. Invariant: a save interval has a directory to save to. What `--load` and `--ref-load` name
on disk (fresh start, our checkpoint, a Hugging Face directory, a Megatron one) is read by
`porting.resolve_load` / `porting.resolve_ref_load` at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config.fields import ConfigError, Slice, flag


@dataclass(frozen=True)
class CheckpointConfig(Slice):
    TITLE = "checkpoint"
    DESCRIPTION = "training checkpoints and weight snapshots"

    save: str | None = flag(None, help="checkpoint directory", metavar="DIR")
    load: str | None = flag(None, help="resume from this checkpoint directory; one that does not exist yet (or "
                            "holds no checkpoint) starts fresh, as slime", metavar="DIR")
    save_interval: int | None = flag(None, help="save every K rollouts", minimum=1)
    save_retain_interval: int | None = flag(None, help="when a checkpoint is saved, delete the previous one unless "
                                            "its rollout id is a multiple of N (as Megatron)", minimum=1)
    ref_load: str | None = flag(None, help="reference model of the KL: a Hugging Face model directory or a rayless "
                                "checkpoint (default: --hf-checkpoint)", metavar="DIR")
    keep_weight_snapshots: int = flag(2, help="weight snapshots for engines kept on disk", minimum=1)

    def check(self) -> None:
        if self.save_interval is not None and self.save is None:
            raise ConfigError("--save-interval needs --save DIR")
        if self.save_retain_interval is not None and self.save is None:
            raise ConfigError("--save-retain-interval needs --save DIR")
