"""Which directory a save dir names, read without torch: `latest`, the markers of a complete checkpoint, the
choice `--load` / `--ckpt-step` make, and whether a checkpoint's adapters are what a run trains.

Owns `resolve_checkpoint` and the names of the layout (`LATEST`, `COMPLETE_MARKERS`); the rank's checkpoint
module (`checkpoint`, which writes and loads with torch's DCP) and the coordinator's start-up checks both read
a save dir through these. Invariant: imports no torch, so a resuming coordinator stays without it; a save dir
whose `latest` is missing, unreadable or names no complete checkpoint is refused (`CheckpointError`) listing
the complete ones and the flag that picks one, never silently continued from another.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from workers.train_rank import checkpoint_files
from workers.train_rank.checkpoint_files import CheckpointError, Extra, read_json

LATEST = "latest"
#: rank 0's last files of a save, and DCP's own index: all present = complete
COMPLETE_MARKERS = ("extra.json", ".metadata", checkpoint_files.MANIFEST)
CHECKPOINT_NAME = re.compile(r"(rollout_|tmp-)(\d+)")


def is_complete(directory: Path) -> bool:
    return directory.is_dir() and all((directory / marker).is_file() for marker in COMPLETE_MARKERS)


def latest_name(save_dir: Path) -> str | None:
    """The directory name `latest` holds; None when it is missing, unreadable or not a plain name."""
    try:
        name = read_json(save_dir / LATEST, str)
    except CheckpointError:
        return None
    if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
        return None
    return name


def complete_checkpoints(save_dir: Path) -> list[tuple[int, Path]]:
    """(rollout id, directory) of every complete `rollout_<id>` in `save_dir`, oldest first."""
    found = []
    for child in save_dir.iterdir() if save_dir.is_dir() else ():
        match = CHECKPOINT_NAME.fullmatch(child.name)
        if match is not None and match.group(1) == "rollout_" and is_complete(child):
            found.append((int(match.group(2)), child))
    return sorted(found)


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a rayless checkpoint: a `rollout_<id>` directory or a save dir with `latest`."""
    try:
        resolve_checkpoint(path)
    except CheckpointError:
        return False
    return True


def check_adapters(directory: Path, saved: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    """A checkpoint loads only into a run training the same thing: the full model, or the same adapters."""
    if saved == current:
        return
    if current is None:
        raise CheckpointError(
            f"{directory} holds LoRA adapters ({_describe(saved)}) and no full-model weights; this run trains "
            "the full model: resume it with the same --lora-rank / --lora-alpha / --target-modules")
    if saved is None:
        raise CheckpointError(
            f"{directory} holds a full-model checkpoint; this run trains LoRA adapters ({_describe(current)}): "
            "drop --lora-rank to resume it, or start LoRA from a Hugging Face directory (--hf-checkpoint)")
    raise CheckpointError(f"{directory} holds LoRA adapters {_describe(saved)}; this run trains "
                          f"{_describe(current)}: give the checkpoint's --lora-* / --target-modules to resume it")


def _describe(record: dict[str, Any] | None) -> str:
    record = record or {}
    return (f"rank {record.get('rank')}, alpha {record.get('alpha')}, target modules "
            f"{','.join(record.get('target_modules') or [])}"
            + (f", excluding {','.join(record['exclude_modules'])}" if record.get("exclude_modules") else ""))


def resolve_checkpoint(path: str | Path, step: int | None = None) -> Path:
    """A save dir (follows `latest`, or takes `rollout_<step>`) or a `rollout_<id>` dir → the complete
    checkpoint directory; `CheckpointError` saying what is wrong and which complete ones there are otherwise."""
    path = Path(path)
    if step is not None and not (path / "extra.json").is_file():
        chosen = path / f"rollout_{step}"
        if not is_complete(chosen):
            raise CheckpointError(f"{chosen}: no complete checkpoint of rollout {step}{_choices(path)}")
        return chosen
    if (path / "extra.json").is_file():
        if not is_complete(path):
            missing = [m for m in COMPLETE_MARKERS if not (path / m).is_file()]
            raise CheckpointError(f"{path}: incomplete checkpoint (no {', '.join(missing)}: its save did not "
                                  "finish)")
        return path
    pointer = path / LATEST
    named = latest_name(path)
    if named is not None and is_complete(path / named):
        return path / named
    if not pointer.exists() and not complete_checkpoints(path):
        raise CheckpointError(f"{path} is neither a checkpoint directory nor a save dir with a '{LATEST}' file")
    if not pointer.exists():
        why = f"{pointer} is missing"
    elif named is None:
        why = f"{pointer} is damaged (not a JSON string naming a directory of {path})"
    else:
        why = f"{pointer} names {named}, which is not a complete checkpoint"
    raise CheckpointError(f"{why}; refusing to guess which checkpoint to continue from{_choices(path)}")


def _choices(save_dir: Path) -> str:
    complete = complete_checkpoints(save_dir)
    if not complete:
        return f"; {save_dir} holds no complete checkpoint"
    steps = ", ".join(str(step) for step, _ in complete)
    return f"; complete checkpoints: rollout {steps}: pick one with --ckpt-step N (e.g. --ckpt-step {complete[-1][0]})"


def checkpoint_adapters(path: str | Path) -> dict[str, Any] | None:
    """The LoRA adapters' record of a checkpoint (None: it holds the full model)."""
    lora = read_json(resolve_checkpoint(path) / "extra.json", Extra).lora
    return dict(lora) if lora is not None else None
