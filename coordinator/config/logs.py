"""The logging slice: the run directory, metric backends and what the terminal shows.

Owns these flags and `resolved_run_dir`. `--wandb-key` is a secret: it is masked in every message and in the
resolved config, and reaches wandb only through `wandb.login`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config import values
from coordinator.config.fields import ConfigError, Slice, flag

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class LoggingConfig(Slice):
    TITLE = "logging"
    DESCRIPTION = "run directory, metrics and progress"

    run_dir: str | None = flag(None, help="where logs, metrics and plots go (default: runs/latest); one run per "
                               "directory: one holding a run is refused unless --load continues it or "
                               "--overwrite-run-dir", metavar="DIR")
    overwrite_run_dir: bool = flag(False, help="start over in a --run-dir that holds a run: its files and the "
                                   "checkpoints in --save are removed as the run starts")
    use_tensorboard: bool = flag(False, help="also write TensorBoard events (when installed)")
    use_wandb: bool = flag(False, help="also log to wandb (when installed)")
    wandb_key: str | None = flag(None, help="wandb API key (default: wandb's own login)", secret=True, metavar="KEY")
    wandb_host: str | None = flag(None, help="wandb server URL (wandb.login host)", metavar="URL")
    wandb_project: str | None = flag(None, help="wandb project")
    wandb_team: str | None = flag(None, help="wandb entity (team)")
    wandb_group: str | None = flag(None, help="wandb group; also the run name, with a random suffix unless "
                                   "--disable-wandb-random-suffix")
    disable_wandb_random_suffix: bool = flag(False, help="wandb run name = --wandb-group, without a random suffix")
    log_passrate: bool = flag(False, help="log slime's pass@k of each rollout's prompt groups (passrate/pass@1, "
                              "@2, @4 ... up to --n-samples-per-prompt; a sample passes with reward 1)")
    no_progress: bool = flag(False, help="plain log lines instead of live progress")
    status_port: int = flag(0, help="serve the run's status page (/), JSON (/status) and Prometheus metrics "
                            "(/metrics) on this port (0 = no status server; docs/observability.md)",
                            minimum=0, maximum=65535, metavar="PORT")
    status_host: str = flag("127.0.0.1", help="address the status server listens on (with --status-port)",
                            parse=values.host, metavar="HOST")
    log_level: str = flag("INFO", help="logging level", choices=LOG_LEVELS)
    loop_stall_warn_s: float = flag(10.0, help="seconds the coordinator's event loop may go without running "
                                    "before its watchdog logs the blocking stack (a hook or reward function "
                                    "doing blocking work on the loop) and the loop's tasks", above=0,
                                    metavar="SECONDS")
    rank_call_warn_s: float = flag(300.0, help="seconds a command to the training ranks may wait (or 3x the "
                                   "longest earlier command of its kind, when more) before the ranks that have "
                                   "not answered are named and every process's stacks collected into "
                                   "RUN_DIR/stacks", above=0, metavar="SECONDS")
    rank_call_timeout_s: float = flag(3600.0, help="seconds a command to the training ranks may wait (or 10x the "
                                      "longest earlier command of its kind, when more) before its wait ends: the "
                                      "stacks collected, then with train FT the ranks that have not answered are "
                                      "killed and restarted, otherwise the run ends naming them", above=0,
                                      metavar="SECONDS")

    def check(self) -> None:
        if self.status_host != "127.0.0.1" and not self.status_port:
            raise ConfigError(f"--status-host {self.status_host} is for the status server, which only "
                              "--status-port PORT starts (0, the default, starts none): give --status-port")

    def wandb_init_kwargs(self, *, suffix: str) -> dict[str, Any]:
        """Keyword arguments of `wandb.init` (slime's: the run is named after the group, plus `suffix`
        unless --disable-wandb-random-suffix)."""
        kwargs: dict[str, Any] = {}
        if self.wandb_project is not None:
            kwargs["project"] = self.wandb_project
        if self.wandb_team is not None:
            kwargs["entity"] = self.wandb_team
        if self.wandb_group is not None:
            kwargs["group"] = self.wandb_group
            kwargs["name"] = self.wandb_group if self.disable_wandb_random_suffix else f"{self.wandb_group}_{suffix}"
        return kwargs

    def wandb_login_kwargs(self) -> dict[str, Any] | None:
        """Keyword arguments of `wandb.login`, or None to use wandb's own login (WANDB_API_KEY, ~/.netrc)."""
        if self.wandb_key is None and self.wandb_host is None:
            return None
        kwargs: dict[str, Any] = {"key": self.wandb_key}
        if self.wandb_host is not None:
            kwargs["host"] = self.wandb_host
        return kwargs

    @property
    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / "latest"
