"""Resumable training state on disk: torch.distributed.checkpoint for model + optimizer, JSON for the rest.

Layout: `<save_dir>/rollout_<id>/` holds the DCP shards, `scheduler.json`, `extra.json` (rollout id and
whatever the coordinator passes, e.g. the data-source position) and one `rng_rank<r>.json` per rank;
`<save_dir>/latest` names the newest complete checkpoint.

With a retain interval N (`--save-retain-interval`, Megatron's rule), saving a checkpoint deletes the one
`latest` named before unless its rollout id is a multiple of N.

Invariant: a checkpoint directory named `rollout_<id>` is always complete. Every rank writes into
`tmp-<id>`; only after a barrier does rank 0 rename it and then replace `latest` atomically, so a crash at
any point leaves the previous checkpoint and pointer intact. No pickle is read here except DCP's own
metadata, which this process wrote.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint path that does not hold a complete rayless checkpoint."""


@dataclass
class LoadedCheckpoint:
    rollout_id: int
    extra: dict[str, Any]
    path: Path


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.random.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.random.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def save_checkpoint(
    save_dir: str | Path,
    rollout_id: int,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any],
    retain_interval: int | None = None,
) -> Path:
    """Collective: every rank calls it with the same arguments. Returns the final directory."""
    save_dir = Path(save_dir)
    rank = _rank()
    tmp = save_dir / f"tmp-{rollout_id}"
    final = save_dir / f"rollout_{rollout_id}"
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    _write_json(tmp / f"rng_rank{rank}.json", _rng_state())
    _barrier()
    if rank == 0:
        _write_json(tmp / "scheduler.json", scheduler.state_dict())
        _write_json(tmp / "extra.json", {"rollout_id": rollout_id, "extra": extra})
        previous = _latest_name(save_dir)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_json(save_dir / LATEST, final.name)
        if retain_interval is not None and previous is not None and previous != final.name:
            _prune(save_dir / previous, retain_interval)
    _barrier()
    return final


def _latest_name(save_dir: Path) -> str | None:
    pointer = save_dir / LATEST
    try:
        name = json.loads(pointer.read_text())
    except (OSError, ValueError):
        return None
    return name if isinstance(name, str) else None


def _prune(directory: Path, retain_interval: int) -> None:
    """Delete a superseded checkpoint unless its rollout id is a multiple of `retain_interval`."""
    prefix = "rollout_"
    if not directory.name.startswith(prefix) or directory.is_symlink():
        return
    try:
        rollout_id = int(directory.name[len(prefix):])
    except ValueError:
        return
    if rollout_id % retain_interval:
        shutil.rmtree(directory, ignore_errors=True)


def is_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a rayless checkpoint: a `rollout_<id>` directory or a save dir with `latest`."""
    try:
        resolve_checkpoint(path)
    except CheckpointError:
        return False
    return True


def load_model_weights(path: str | Path, model: Any) -> Path:
    """Load only the model weights of a rayless checkpoint into an unsharded `model` (the KL reference)."""
    directory = resolve_checkpoint(path)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(directory))
    model.load_state_dict(state["model"])
    return directory


def resolve_checkpoint(path: str | Path) -> Path:
    """A save dir (follows `latest`) or a `rollout_<id>` dir → the complete checkpoint directory."""
    path = Path(path)
    if (path / "extra.json").is_file():
        return path
    pointer = path / LATEST
    if pointer.is_file():
        target = path / json.loads(pointer.read_text())
        if (target / "extra.json").is_file():
            return target
        raise CheckpointError(f"{pointer} names {target.name}, which is not a complete checkpoint")
    raise CheckpointError(f"{path} is neither a checkpoint directory nor a save dir with a '{LATEST}' file")


def load_checkpoint(
    path: str | Path, *, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any
) -> LoadedCheckpoint:
    """Collective: restores model, optimizer, scheduler and this rank's RNG; returns the rollout id."""
    directory = resolve_checkpoint(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(json.loads((directory / "scheduler.json").read_text()))
    rng_file = directory / f"rng_rank{_rank()}.json"
    if rng_file.is_file():
        _set_rng_state(json.loads(rng_file.read_text()))
    meta = json.loads((directory / "extra.json").read_text())
    _barrier()
    return LoadedCheckpoint(
        rollout_id=int(meta["rollout_id"]), extra=dict(meta.get("extra") or {}), path=directory
    )
