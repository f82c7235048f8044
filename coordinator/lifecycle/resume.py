"""The command that resumes a run that did not finish (stopped by a signal, or failed).

Owns `resume_hint` and `resume_command`: the run's own arguments, as it was started, with `--load` naming the
newest checkpoint on disk — the `--save` directory once it holds one (its `latest`), else the checkpoint this
run resumed from — and without `--overwrite-run-dir` (which would remove the run the command continues).
Invariant: the command is printed only when a checkpoint exists to resume from; it is run from the directory
named beside it (relative paths in it are relative to that directory).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from coordinator.config.checkpoint import checkpoint_rollout
from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config

#: flags dropped from the resume command, with how many values each takes
_DROPPED = {"--load": 1, "--overwrite-run-dir": 0}


def program() -> list[str]:
    """How this process was started: `rayless`, or `python -m coordinator.cli` (this interpreter)."""
    if Path(sys.argv[0]).name == "rayless":
        return ["rayless"]
    return [sys.executable, "-m", "coordinator.cli"]


def resume_command(argv: Sequence[str], load: str) -> str:
    """`rayless train ARGV... --load LOAD`, any `--load` / `--overwrite-run-dir` in `argv` left out."""
    kept: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _DROPPED:
            skip = _DROPPED[name] if "=" not in arg else 0
            continue
        kept.append(arg)
    return shlex.join([*program(), "train", *kept, "--load", load])


def resume_hint(config: Config, argv: Sequence[str], *, stopped: bool = True) -> str | None:
    """What to run to continue this run, or (`stopped` by a signal) why it cannot be continued; None when there is
    nothing to say (a failure with no checkpoint: its own message is what matters)."""
    save = config.checkpoint.save
    rollout = checkpoint_rollout(Path(save)) if save else None
    load = save if rollout is not None else None
    if load is None:
        try:
            plan = config.load_plan()
        except ConfigError:
            plan = None
        if plan is not None and plan.resume and plan.path is not None:
            load, rollout = plan.path, checkpoint_rollout(Path(plan.path))
    if load is None:
        if not stopped or not config.needs_train_ranks:
            return None
        if not save:
            return "this run saved no checkpoint (no --save DIR), so it cannot be resumed"
        return f"no checkpoint in --save {save} yet: nothing to resume from"
    return (f"to resume from the checkpoint of rollout {rollout} ({load}), run from {os.getcwd()}:\n"
            f"  {resume_command(argv, load)}")
