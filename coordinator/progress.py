"""Terminal progress and the run's metrics file.

Owns what a person watching the run sees (a live rich status line on a terminal, plain log lines otherwise or
with `--no-progress`) and `metrics.jsonl` in the run directory: one JSON object per line, each with `step`
(the rollout id) and a `time`. Invariants: every line of metrics.jsonl is a complete JSON object (written
and flushed in one call), so a crash never leaves a torn line that breaks the reader; and the file tells one
history: a run resumed at rollout N (`--load`) redoes every step from N, so `resume_at(N)` first drops the
rows of steps >= N that an earlier run wrote (they describe training the checkpoint no longer holds) and the
resumed run's rows replace them — each step appears once. TensorBoard is told the same (`purge_step`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TextIO

log = logging.getLogger("rayless")


class HasLine(Protocol):
    def line(self) -> str: ...


class ProgressDisplay:
    def __init__(self, *, enabled: bool, min_interval: float = 0.25, log_interval: float = 10.0) -> None:
        self.live = enabled and sys.stderr.isatty()
        self.min_interval = min_interval
        self.log_interval = log_interval

    @contextmanager
    def __call__(self, title: str, source: HasLine) -> Iterator[Callable[[], None]]:
        if self.live:
            from rich.console import Console
            from rich.live import Live

            console = Console(stderr=True)
            last = 0.0
            with Live(console=console, refresh_per_second=4, transient=True) as live:

                def refresh() -> None:
                    nonlocal last
                    now = time.monotonic()
                    if now - last >= self.min_interval:
                        last = now
                        live.update(f"[bold]{title}[/]  {source.line()}")

                refresh()
                yield refresh
            return
        last_logged = time.monotonic()

        def log_refresh() -> None:
            nonlocal last_logged
            now = time.monotonic()
            if now - last_logged >= self.log_interval:
                last_logged = now
                log.info("%s  %s", title, source.line())

        yield log_refresh


class MetricsLog:
    """Appends metrics to `<run_dir>/metrics.jsonl` (and to TensorBoard / wandb when asked); keeps them in
    memory for the end-of-run plot."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False, wandb: bool = False,
                 wandb_key: str | None = None, wandb_login: dict[str, Any] | None = None,
                 wandb_init: dict[str, Any] | None = None) -> None:
        """`wandb_login` / `wandb_init`: keyword arguments of `wandb.login` / `wandb.init` (the logging slice's
        `wandb_login_kwargs` / `wandb_init_kwargs`: slime's project, team, group, run name, host, key)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file: TextIO = self.path.open("a", encoding="utf-8")
        self.history: list[dict[str, Any]] = []
        self._tensorboard: Any = None
        self._wandb: Any = None
        self._tensorboard_dir = run_dir / "tensorboard"
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(self._tensorboard_dir))
        if wandb:
            import wandb as wandb_module

            login = wandb_login if wandb_login is not None else ({"key": wandb_key} if wandb_key else None)
            if login:  # `--wandb-key` / `--wandb-host`; otherwise wandb's own login (WANDB_API_KEY, ~/.netrc)
                wandb_module.login(**login)
            self._wandb = wandb_module.init(dir=str(run_dir), config={"run_dir": str(run_dir)},
                                            **(wandb_init or {}))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        self.history.append(record)
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and k not in ("step", "time")}
        if self._tensorboard is not None:
            for key, value in numbers.items():
                self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def resume_at(self, rollout_id: int) -> int:
        """The run resumes at `rollout_id`: drop every row of a step >= it (an earlier run's, about to be
        redone) from the file — rewritten atomically — and from `history`. Returns how many were dropped."""
        self._file.close()
        kept: list[str] = []
        dropped = 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            step = _step_of(line)
            if step is not None and step >= rollout_id:
                dropped += 1
            else:
                kept.append(line)
        if dropped:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            os.replace(tmp, self.path)
            log.info("metrics: dropped %d row(s) of steps >= %d written before the resume", dropped, rollout_id)
        self._file = self.path.open("a", encoding="utf-8")
        self.history = [row for row in self.history if row["step"] < rollout_id]
        if self._tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard.close()
            self._tensorboard = SummaryWriter(log_dir=str(self._tensorboard_dir), purge_step=rollout_id)
        return dropped

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def missing_metric_backends(*, tensorboard: bool, wandb: bool) -> list[str]:
    """The asked-for metric backends that are not installed (checked at start-up, before any launch)."""
    import importlib.util

    missing = []
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        missing.append("--use-tensorboard needs the tensorboard package (pip install tensorboard)")
    if wandb and importlib.util.find_spec("wandb") is None:
        missing.append("--use-wandb needs the wandb package (pip install wandb)")
    return missing


def _step_of(line: str) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if type(step) is int else None


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_rewards(history: list[dict[str, Any]], path: Path) -> Path | None:
    """Reward / response length / timing curves to a PNG at the end of a run (matplotlib, no display)."""
    rows = [row for row in history if "rollout/reward_mean" in row]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in rows]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [row["rollout/reward_mean"] for row in rows], marker=".")
    axes[0].set_title("mean reward")
    axes[1].plot(steps, [row.get("rollout/response_len_mean", 0) for row in rows], marker=".")
    axes[1].set_title("mean response length")
    for key, label in (("rollout/time_s", "rollout"), ("train/time_s", "train"), ("sync/time_s", "weight sync")):
        values = [row.get(key) for row in rows]
        if any(v is not None for v in values):
            axes[2].plot(steps, [v if v is not None else float("nan") for v in values], label=label)
    axes[2].set_title("seconds per rollout")
    axes[2].legend()
    for axis in axes:
        axis.set_xlabel("rollout")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
