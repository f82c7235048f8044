"""One run per run directory: the start-up check of `--run-dir` (and `--save`), and `--overwrite-run-dir`.

Owns `check_run_dir` (run by `preflight` and `--dry-run`, before anything launches) and `clear_run_dir` (run as
the run starts, with `--overwrite-run-dir`). A directory holds a run once its metrics.jsonl has a row or it has
a summary.json; a `--save` directory holds one once it has a checkpoint. Starting a run into either is refused
(a ConfigError: exit status 2) with the three ways on — a new directory, `--load` to continue that run, or
`--overwrite-run-dir` — unless `--load` resumes (a resumed run continues the same metrics.jsonl: its rows past
the checkpoint are replaced, `coordinator.observe.progress.MetricsLog.resume_at`). Invariant: `clear_run_dir`
removes only the files a run writes (`RUN_ENTRIES`) and the checkpoints of `--save` (`CHECKPOINT_ENTRIES`),
nothing else a person keeps there.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from coordinator.config.checkpoint import checkpoint_rollout, run_config
from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config

#: set by `./run.sh` for its default job (whose run directory is `RAYLESS_RUN_DIR`, its save directory inside it)
DEFAULT_JOB_ENV = "RAYLESS_DEFAULT_JOB"
#: what a run writes in its run directory (docs/running.md, "What a run writes")
RUN_ENTRIES = ("metrics.jsonl", "summary.json", "status.json", "status_url", "rewards.png", "timeline.json",
               "config.json", "plan.txt", "coordinator.log", "train_ranks.log", "logs", "weights", "eval_weights",
               "tensorboard", "wandb")
#: what a save directory holds (`workers.train_rank.checkpoint`)
CHECKPOINT_ENTRIES = re.compile(r"latest|(?:rollout_|tmp-|old-|staging-)\d+")


@dataclass(frozen=True)
class EarlierRun:
    """What an earlier run left in a run directory: which rollouts its metrics hold, and how it ended (its
    summary's outcome: "finished", "interrupted", "failed"; None while it runs or when it died unsummarised)."""

    held: str
    outcome: str | None

    def __str__(self) -> str:  # "rollouts 0..59 in metrics.jsonl, finished"
        return self.held + (f", {self.outcome}" if self.outcome is not None else "")


def earlier_run(run_dir: Path) -> EarlierRun | None:
    """What an earlier run left in `run_dir`, or None when it holds no run (missing, empty, or a run stopped
    before its first rollout)."""
    metrics = run_dir / "metrics.jsonl"
    steps: list[int] = []
    try:
        with metrics.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and type(row.get("step")) is int:
                    steps.append(row["step"])
    except OSError:
        pass
    summary = run_dir / "summary.json"
    if not steps and not summary.is_file():
        return None
    held = f"rollouts {min(steps)}..{max(steps)} in metrics.jsonl" if steps else "a summary.json"
    try:
        outcome = json.loads(summary.read_text()).get("outcome", "finished")
    except (OSError, ValueError, AttributeError):
        outcome = None
    return EarlierRun(held, outcome if isinstance(outcome, str) else None)


def check_run_dir(config: Config) -> list[str]:
    """Refuse a run into a run directory (or a --save directory) that holds another run, unless it resumes. The
    coordinator's node checks it (node k > 0 writes no metrics, and may be restarted while the run goes on)."""
    if config.cluster.actor_node_rank > 0:
        return []
    run_dir = config.logging.resolved_run_dir
    save = config.checkpoint.save
    try:
        load = config.load_plan()
    except ConfigError:
        return []  # check_checkpoints says what is wrong with --load
    held = earlier_run(run_dir)
    saved = checkpoint_rollout(Path(save)) if save and config.needs_train_ranks else None
    if config.logging.overwrite_run_dir:
        if load.resume:
            raise ConfigError(f"--overwrite-run-dir and --load {config.checkpoint.load} contradict each other: "
                              "--load continues the run, --overwrite-run-dir removes it; give one of them")
        removed = [f"{run_dir}'s earlier run ({held})"] * (held is not None)
        removed += [f"the checkpoints in --save {save} (newest: rollout {saved})"] * (saved is not None)
        return [f"--overwrite-run-dir: {' and '.join(removed)} will be removed as the run starts"] if removed \
            else [f"--overwrite-run-dir: {run_dir} holds no earlier run; nothing to remove"]
    if load.resume:
        return [f"--run-dir {run_dir}: continues the run there ({held})"] if held is not None else []
    if held is None and saved is None:
        return [f"--run-dir {run_dir}: a new run directory"] if not run_dir.exists() else \
            [f"--run-dir {run_dir}: holds no earlier run"]
    what = (f"--run-dir {run_dir} holds a run already ({held})" if held is not None
            else f"--save {save} holds the checkpoints of another run (newest: rollout {saved})")
    if os.environ.get(DEFAULT_JOB_ENV) == "1":  # `./run.sh`: its user gives no flags, so the choices are its own
        stopped = saved is not None and (held is None or held.outcome != "finished")
        choices = [f"a new run: RAYLESS_RUN_DIR={shlex.quote(str(_free_name(run_dir)))} ./run.sh",
                   *[f"continue it from its checkpoint of rollout {saved}: the `rayless train ... --load {save}` "
                     "command it printed as it stopped"] * stopped,
                   f"start over: rm -r {shlex.quote(str(run_dir))} && ./run.sh"]
    else:
        choices = [f"a new run: --run-dir {_free_name(run_dir)}" + (" with another --save" if save else ""),
                   f"continue that run: {_continue_choice(run_dir, save, saved)}",
                   "start over in it, removing the earlier run's files"
                   + (f" and the checkpoints in --save {save}" if saved is not None else "") + ": --overwrite-run-dir"]
    raise ConfigError(f"{what}; a run directory holds one run. Choose one:\n"
                      + "\n".join(f"  - {choice}" for choice in choices))


def _continue_choice(run_dir: Path, save: str | None, saved: int | None) -> str:
    if saved is not None:
        return f"--load {save} (its checkpoint of rollout {saved})"
    earlier = run_config(run_dir) or {}
    earlier_save = earlier.get("save")
    if isinstance(earlier_save, str) and checkpoint_rollout(Path(earlier_save)) is not None:
        return f"--load {earlier_save} (its checkpoint of rollout {checkpoint_rollout(Path(earlier_save))})"
    return "not possible: it saved no checkpoint (a run resumes only with --save DIR)"


def _free_name(run_dir: Path) -> Path:
    """`runs/default-2` (the first of -2, -3, ... that does not exist)."""
    number = 2
    while run_dir.with_name(f"{run_dir.name}-{number}").exists():
        number += 1
    return run_dir.with_name(f"{run_dir.name}-{number}")


def clear_run_dir(run_dir: Path, *, save: str | None) -> list[str]:
    """`--overwrite-run-dir`: remove what an earlier run wrote in `run_dir` and the checkpoints in `save`; the
    names removed."""
    removed = []
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    if save and Path(save).is_dir():
        checkpoints = [child for child in Path(save).iterdir() if CHECKPOINT_ENTRIES.fullmatch(child.name)]
        for child in checkpoints:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        if checkpoints:
            removed.append(f"{len(checkpoints)} checkpoint entries in {save}")
    return removed
