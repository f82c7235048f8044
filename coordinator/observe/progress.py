"""Terminal progress and the run's metrics file.

Owns what a person watching the run sees — the start-up board (each launched process's phase), a run-level
bar (n/N rollouts done, elapsed, ETA) and the current rollout's line — live with rich on a terminal, or as plain
log lines otherwise and with `--no-progress` — and `metrics.jsonl` in the run directory: one JSON object per
line, each with `step` (the rollout id) and a `time`. Invariant: every line of metrics.jsonl is a complete
JSON object (written and flushed in one call), so a crash never leaves a torn line that breaks the reader;
and the file tells one history: a run resumed at rollout N (`--load`) redoes every step from N, so
`resume_at(N)` first drops the rows of steps >= N that an earlier run wrote (they describe training the
checkpoint no longer holds) and the resumed run's rows replace them — each step appears once. The rows kept
are read back into `history`, so the summary and the plot of a resumed run cover the whole run. TensorBoard is
told the same (`purge_step`).
Rich's live view and the log handler share one console (`stderr_console`), so log lines print above it.
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

import anyio

from coordinator.lifecycle.logs import stderr_console
from coordinator.observe.startup import StartupBoard

log = logging.getLogger("rayless")


class HasLine(Protocol):
    def line(self) -> str: ...


def clock(seconds: float) -> str:
    """0:00:42 style."""
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class RunProgress:
    """Rollouts done of this run, elapsed time and the ETA from the mean wall time per rollout so far."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.first = 0
        self.total = 0
        self.done = 0
        self.loop_started: float | None = None
        #: what the current step is doing, when someone says (the colocation swap's phases)
        self.phase = ""

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        log.debug("phase: %s", phase)

    def begin(self, first: int, total: int) -> None:
        """The loop runs rollouts `first`..`total - 1` (a resumed run starts past 0)."""
        self.first, self.total, self.done = first, total, 0
        self.loop_started = time.monotonic()

    def rollout_done(self, rollout_id: int) -> None:
        self.done = max(self.done, rollout_id + 1 - self.first)

    @property
    def remaining(self) -> int:
        return max(0, self.total - self.first - self.done)

    def eta(self) -> float | None:
        if self.loop_started is None or self.done == 0:
            return None
        return (time.monotonic() - self.loop_started) / self.done * self.remaining

    def timing_text(self) -> str:
        """`elapsed 0:00:31  ETA 0:00:29` (ETA `?` before the first rollout is done)."""
        eta = self.eta()
        return f"elapsed {clock(time.monotonic() - self.started)}  ETA {clock(eta) if eta is not None else '?'}"

    def text(self, width: int = 20) -> str:
        """`━━━━━━────── 6/12 rollouts  elapsed 0:00:31  ETA 0:00:29`."""
        finished = self.first + self.done
        filled = round(width * finished / self.total) if self.total else 0
        phase = f"  · {self.phase}" if self.phase else ""
        return (f"{'━' * filled}{'─' * (width - filled)} {finished}/{self.total} rollouts  {self.timing_text()}"
                f"{phase}")


class ProgressDisplay:
    """The run's terminal view: `run_view` (a service for the whole run), the start-up `board` launchers
    report to, `run` (rollouts done, ETA) the loop updates, and `__call__(title, source)` for the current
    rollout's line."""

    def __init__(self, *, enabled: bool, min_interval: float = 0.25, log_interval: float = 10.0,
                 mask: Callable[[str], str] | None = None) -> None:
        self.live = enabled and sys.stderr.isatty()
        self.min_interval = min_interval
        self.log_interval = log_interval
        self.board = StartupBoard(mask=mask)
        self.run = RunProgress()
        self._current: tuple[str, HasLine] | None = None

    async def run_view(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: the live view on a terminal; otherwise, while start-up waits, one line every
        `log_interval` naming who is still being waited for."""
        if self.live:
            from rich.live import Live

            with Live(get_renderable=self.render, console=stderr_console(), refresh_per_second=4,
                      transient=True):
                task_status.started()
                await anyio.sleep_forever()
        task_status.started()
        while True:
            await anyio.sleep(self.log_interval)
            if self.board.waiting():
                log.info("%s", self.board.waiting_line())

    def render(self) -> Any:
        """The live view: processes not yet serving, the run bar, the current rollout's line."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        parts: list[Any] = []
        waiting = self.board.waiting()
        if waiting:
            table = Table(box=None, show_header=False, pad_edge=False, title_justify="left")
            now = time.monotonic()
            for row in waiting:
                style = "red" if row.phase == "failed" else "yellow"
                table.add_row(Text(row.name, style="bold"), Text(row.where, style="dim"),
                              Text(row.phase, style=style), f"{row.elapsed(now):.0f}s",
                              Text(row.detail, style="dim", overflow="ellipsis", no_wrap=True))
            parts.append(table)
        if self.run.total:
            parts.append(Text(self.run.text(), style="cyan"))
        current = self._current
        if current is not None:
            parts.append(Text.from_markup(f"[bold]{current[0]}[/]  ") + Text(current[1].line()))
        return Group(*parts)

    @property
    def current(self) -> tuple[str, HasLine] | None:
        """The rollout generating now, as `(title, source)` (its progress object), or None between rollouts."""
        return self._current

    @contextmanager
    def __call__(self, title: str, source: HasLine) -> Iterator[Callable[[], None]]:
        """The current rollout's line while it generates; yields `refresh` (a no-op for the live view, which
        redraws by itself; a log line every `log_interval` otherwise)."""
        self._current = (title, source)
        try:
            yield (lambda: None) if self.live else self._log_refresh(title, source)
        finally:
            self._current = None

    def _log_refresh(self, title: str, source: HasLine) -> Callable[[], None]:
        last_logged = time.monotonic()

        def log_refresh() -> None:
            nonlocal last_logged
            now = time.monotonic()
            if now - last_logged >= self.log_interval:
                last_logged = now
                run = f"  | {self.run.text()}" if self.run.total else ""
                log.info("%s  %s%s", title, source.line(), run)

        return log_refresh


#: The keys of a metrics row that `MetricsLog.history` keeps: what `plot_rewards` draws and the summary reads.
#: `rollout/tokens_per_s/<engine>`: an engine's share of the rollout's tokens/s (coordinator.rollout.generate
#: writes it, the status page and `/metrics` read it from the last row)
ENGINE_RATE_PREFIX = "rollout/tokens_per_s/"
_KEPT = ("step", "rollout/reward_mean", "rollout/response_len_mean", "rollout/time_s", "train/time_s",
         "sync/time_s")


def is_evaluation_row(row: dict[str, Any]) -> bool:
    """A row an evaluation wrote (on the rollout engines or the eval fleet, a skipped one's too), beside its
    rollout's own: `eval/` figures and no rollout's or train step's."""
    return any(key.startswith("eval/") for key in row) and not any(
        key.startswith(("rollout/", "train/")) for key in row)


class MetricsLog:
    """Appends metrics to `<run_dir>/metrics.jsonl` (and to TensorBoard / wandb when asked). `history` keeps,
    per rollout, only what the end-of-run plot and summary read (`_KEPT`): a long run holds ~0.5 KB per rollout
    in memory, not its every metric (~2.4 KB). An evaluation's rows go to the file and the trackers only: the
    history, the status page's recent rows and `last` (the status page's and `/metrics`' latest rollout) are
    the rollouts'."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = False, wandb: bool = False,
                 wandb_key: str | None = None, wandb_login: dict[str, Any] | None = None,
                 wandb_init: dict[str, Any] | None = None) -> None:
        """`wandb_login` / `wandb_init`: keyword arguments of `wandb.login` / `wandb.init` (the logging slice's
        `wandb_login_kwargs` / `wandb_init_kwargs`: slime's project, team, group, run name, host, key)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file: TextIO = self.path.open("a", encoding="utf-8")
        self.history: list[dict[str, Any]] = []
        #: more figures for every row, read as it is written (the loop watchdog's lag over the step)
        self.row_sources: list[Callable[[], dict[str, Any]]] = []
        #: the last row in full (the status page's per-engine tokens/s are read from it)
        self.last: dict[str, Any] = {}
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
        for source in self.row_sources:
            metrics = {**source(), **metrics}
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        if not is_evaluation_row(record):  # an evaluation's row is the file's, not a rollout of the history
            self.history.append({key: record[key] for key in _KEPT if key in record})
            self.last = record
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
        redone) from the file — rewritten atomically — and make `history` the rows kept (the earlier runs'
        steps < `rollout_id`, read back). Returns how many were dropped."""
        self._file.close()
        kept: list[str] = []
        earlier: list[dict[str, Any]] = []
        dropped = 0
        for line in self.path.read_text(encoding="utf-8").splitlines():
            row = _row_of(line)
            step = row.get("step") if row is not None else None
            if type(step) is int and step >= rollout_id:
                dropped += 1
                continue
            kept.append(line)
            if type(step) is int and not is_evaluation_row(row):  # type: ignore[arg-type]
                earlier.append({key: row[key] for key in _KEPT if key in row})  # type: ignore[index]
        if dropped:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            os.replace(tmp, self.path)
            log.info("metrics: dropped %d row(s) of steps >= %d written before the resume", dropped, rollout_id)
        self._file = self.path.open("a", encoding="utf-8")
        self.history = earlier  # the file holds every row this process wrote as well
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


def _row_of(line: str) -> dict[str, Any] | None:
    """A metrics line as a dict; None for a line that is not one (kept as it is, never read back)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


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
    timed = False
    for key, label in (("rollout/time_s", "rollout"), ("train/time_s", "train"), ("sync/time_s", "weight sync")):
        values = [row.get(key) for row in rows]
        if any(v is not None for v in values):
            axes[2].plot(steps, [v if v is not None else float("nan") for v in values], label=label)
            timed = True
    axes[2].set_title("seconds per rollout")
    if timed:  # matplotlib warns about a legend with nothing in it
        axes[2].legend()
    for axis in axes:
        axis.set_xlabel("rollout")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
