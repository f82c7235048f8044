"""The logging slice: the run directory, metric backends and what the terminal shows.

Owns these flags and `resolved_run_dir`. `--wandb-key` is a secret: it is masked in every message and in the
resolved config, and reaches wandb only through `wandb.login`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coordinator.config.fields import Slice, flag

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class LoggingConfig(Slice):
    TITLE = "logging"
    DESCRIPTION = "run directory, metrics and progress"

    run_dir: str | None = flag(None, help="where logs, metrics and plots go (default: runs/latest)",
                                metavar="DIR")
    use_tensorboard: bool = flag(False, help="also write TensorBoard events (when installed)")
    use_wandb: bool = flag(False, help="also log to wandb (when installed)")
    wandb_key: str | None = flag(None, help="wandb API key (default: wandb's own login)", secret=True, metavar="KEY")
    no_progress: bool = flag(False, help="plain log lines instead of live progress")
    log_level: str = flag("INFO", help="logging level", choices=LOG_LEVELS)

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / "latest"
