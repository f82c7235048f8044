"""Resumable training state on disk: torch.distributed.checkpoint for model + optimizer, JSON for the rest.

Layout: `<save_dir>/rollout_<id>/` holds the DCP shards (the policy's `model` and `optim`; with PPO's critic its
`critic` and `critic_optim` too), `scheduler.json` (and the critic's `critic_scheduler.json`), `extra.json` (rollout id, whatever
the coordinator passes, e.g. the data-source position, the LoRA record and the base model trained, for `rayless
export`) and one `rng_rank<r>.json` per rank; `<save_dir>/latest` names the newest complete checkpoint.
`manifest.json` (every other file's size and digest, `checkpoint_files`) is written last, by rank 0 after a
barrier: a directory holding it, `extra.json` and DCP's `.metadata` is complete, and what it lists is checked
before anything loads (`checkpoint_files.verify_checkpoint`).

Invariants:
- A directory named `rollout_<id>` is always complete, and from the first save on, `latest` names a
  complete checkpoint at every instant. Every rank writes into `tmp-<id>`; after a barrier rank 0 publishes
  it (`publish_steps`). A first save of `<id>` renames it to `rollout_<id>`, then replaces `latest`. A re-save
  of an `<id>` cannot rename over the old directory, so it goes in steps that each keep `latest` on a
  complete directory: `latest` → `tmp-<id>`; the old `rollout_<id>` moves aside to `old-<id>`; a hard-linked
  copy of `tmp-<id>` is renamed to `rollout_<id>`; `latest` → `rollout_<id>`; `tmp-<id>` and `old-<id>` go.
  Every rename and every write of `latest` is atomic, so a crash between any two steps leaves `latest` on a
  complete checkpoint of the newest saved rollout, and the next save first finishes that publish (`_settle`).
- `resolve_checkpoint` (`checkpoint_layout`, torch-free: the coordinator resolves `--load` with it) follows `latest`, or picks `rollout_<step>` when given a step (`--ckpt-step`); when
  `latest` is missing, unreadable or names no complete checkpoint it refuses (`CheckpointError`) and lists
  the complete checkpoints with the flag that picks one: a run asked to continue from one point never
  silently continues from another.
- Nothing is unpickled by `pickle`: DCP's metadata and non-tensor values are read through
  `checkpoint_files.safe_reader` / `safe_planner` (allow-listed classes, `weights_only`); JSON files through
  the boundary layer's bounded, typed decode.
- With a retain interval N (`--save-retain-interval`, Megatron's rule), publishing a checkpoint deletes the
  one `latest` named before unless its rollout id is a multiple of N.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from workers.boundary.manifest import fsync_directory
from workers.train_rank import checkpoint_files
from workers.train_rank.checkpoint_files import (
    CheckpointError,
    RngState,
    read_json,
    write_json_durably,
)
from workers.train_rank.checkpoint_layout import (  # re-exported: the rank's and the tests' names for them
    CHECKPOINT_NAME,
    LATEST,
    check_adapters,
    is_complete,
    latest_name,
    resolve_checkpoint,
)
from workers.train_rank.checkpoint_layout import (
    COMPLETE_MARKERS as COMPLETE_MARKERS,
)
from workers.train_rank.checkpoint_layout import (
    checkpoint_adapters as checkpoint_adapters,
)
from workers.train_rank.checkpoint_layout import (
    complete_checkpoints as complete_checkpoints,
)
from workers.train_rank.checkpoint_layout import (
    is_checkpoint as is_checkpoint,
)

log = logging.getLogger(__name__)


#: the critic's schedule beside the policy's; its presence says the checkpoint holds a critic
CRITIC_SCHEDULER = "critic_scheduler.json"


@dataclass
class CriticState:
    """PPO's value model, saved and restored with the policy (`train_rank.critic.Critic`)."""

    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any


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
    write_json_durably(path, value)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.random.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.random.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------- saving


def save_checkpoint(
    save_dir: str | Path,
    rollout_id: int,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any],
    retain_interval: int | None = None,
    adapters: dict[str, Any] | None = None,
    write_files: Callable[[Path], None] | None = None,
    base_model: dict[str, Any] | None = None,
    publish: bool = True,
    critic: CriticState | None = None,
) -> Path:
    """Collective: every rank calls it with the same arguments. Returns the final directory (with
    `publish=False`, the complete `tmp-<id>` that `publish_checkpoint` publishes later).

    adapters: the LoRA adapters' record (`LoraSpec.record()`), kept in extra.json so a resume can tell a
    checkpoint of other adapters; write_files: called by every rank with the tmp directory before it is
    complete (the adapters in the PEFT format); base_model: the model trained (`hf_checkpoint`, `dtype`), kept
    in extra.json for `rayless export`."""
    save_dir = Path(save_dir)
    write_tmp(save_dir, rollout_id, model=model, optimizer=optimizer, scheduler=scheduler, extra=extra,
              adapters=adapters, write_files=write_files, base_model=base_model, critic=critic)
    if not publish:
        _barrier()
        return save_dir / f"tmp-{rollout_id}"
    if _rank() == 0:
        publish_checkpoint(save_dir, rollout_id, retain_interval=retain_interval)
    _barrier()
    return save_dir / f"rollout_{rollout_id}"


def publish_checkpoint(save_dir: str | Path, rollout_id: int, *, retain_interval: int | None = None) -> Path:
    """Rank 0: the complete `tmp-<id>` becomes `rollout_<id>`, the checkpoint `latest` names; the one named
    before is pruned by the retain interval. A tmp directory that is not complete is an error."""
    save_dir = Path(save_dir)
    tmp = save_dir / f"tmp-{rollout_id}"
    if not is_complete(tmp):
        raise CheckpointError(f"{tmp}: not a complete checkpoint to publish (its save did not finish)")
    previous = latest_name(save_dir)
    for index, step in enumerate(publish_steps(save_dir, rollout_id)):
        if index == 1:
            drill_pause("publish", rollout_id)  # between the first two steps of publishing
        step()
    if retain_interval is not None and previous is not None and previous != f"rollout_{rollout_id}":
        _prune(save_dir / previous, retain_interval)
    return save_dir / f"rollout_{rollout_id}"


def write_tmp(
    save_dir: Path, rollout_id: int, *, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
    extra: dict[str, Any], adapters: dict[str, Any] | None = None,
    write_files: Callable[[Path], None] | None = None, base_model: dict[str, Any] | None = None,
    critic: CriticState | None = None,
) -> Path:
    """Collective: the complete checkpoint in `tmp-<id>`, not yet published (rank 0 publishes it)."""
    rank = _rank()
    tmp = save_dir / f"tmp-{rollout_id}"
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        # An interrupted publish first: `latest` may name the tmp directory this save is about to reuse.
        _settle(save_dir)
        prepare_tmp(save_dir, rollout_id)
    _barrier()
    complete_optimizer_state(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    model_state = _without_frozen(model, model_state)
    shards: dict[str, Any] = {"model": model_state, "optim": optim_state}
    if critic is not None:
        complete_optimizer_state(critic.optimizer)
        shards["critic"], shards["critic_optim"] = get_state_dict(critic.model, critic.optimizer)
    dcp.save(shards, checkpoint_id=str(tmp))
    _write_json(tmp / f"rng_rank{rank}.json", _rng_state())
    if write_files is not None:
        write_files(tmp)
    drill_pause("shards", rollout_id)
    _barrier()
    if rank == 0:
        _write_json(tmp / "scheduler.json", scheduler.state_dict())
        if critic is not None:
            _write_json(tmp / CRITIC_SCHEDULER, critic.scheduler.state_dict())
        meta: dict[str, Any] = {"rollout_id": rollout_id, "extra": extra}
        if adapters is not None:
            meta["lora"] = adapters
        if base_model is not None:
            meta["base_model"] = base_model
        _write_json(tmp / "extra.json", meta)
        drill_pause("extra", rollout_id)
        checkpoint_files.write_manifest(tmp)  # last: now complete
        drill_pause("complete", rollout_id)
    return tmp


#: `phase:rollout_id:marker` — a crash drill's pause (tests/integration/test_train_lora.py): at that phase of that
#: rollout's save, rank 0 creates the marker file and waits there, so the drill SIGKILLs the coordinator at a
#: known point of a real save. Unset in every run but the drill's.
ENV_DRILL_PAUSE = "RAYLESS_DRILL_SAVE_PAUSE"
DRILL_PAUSE_S = 120.0


def drill_pause(phase: str, rollout_id: int) -> None:
    wanted = os.environ.get(ENV_DRILL_PAUSE)
    if not wanted or _rank() != 0:
        return
    want_phase, _, rest = wanted.partition(":")
    want_id, _, marker = rest.partition(":")
    if want_phase != phase or want_id != str(rollout_id) or not marker:
        return
    Path(marker).write_text(f"{phase} {rollout_id} {os.getpid()}\n")
    import time

    deadline = time.monotonic() + DRILL_PAUSE_S  # the drill ends the process long before
    while time.monotonic() < deadline:
        time.sleep(0.05)


def prepare_tmp(save_dir: Path, rollout_id: int) -> Path:
    """Rank 0: an empty `tmp-<id>` for the ranks to write into."""
    tmp = save_dir / f"tmp-{rollout_id}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish_steps(save_dir: Path, rollout_id: int) -> list[Callable[[], None]]:
    """Rank 0's steps that make the complete `tmp-<id>` the checkpoint `latest` names, in order. Each is
    atomic or touches only what `latest` does not name, so stopping after any of them leaves `latest` on a
    complete checkpoint (the module's invariant; tests stop after each one)."""
    tmp = save_dir / f"tmp-{rollout_id}"
    final = save_dir / f"rollout_{rollout_id}"
    old = save_dir / f"old-{rollout_id}"
    staging = save_dir / f"staging-{rollout_id}"
    if not final.exists():
        return [lambda: _rename(tmp, final), lambda: _point_latest(save_dir, final)]

    def move_old_aside() -> None:
        shutil.rmtree(old, ignore_errors=True)
        _rename(final, old)

    def link_new_into_place() -> None:
        # a copy, not a rename: `latest` names tmp until the next step
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(tmp, staging, copy_function=_link_or_copy)
        _rename(staging, final)

    def remove_the_rest() -> None:
        shutil.rmtree(tmp)
        shutil.rmtree(old, ignore_errors=True)

    return [
        lambda: _point_latest(save_dir, tmp),
        move_old_aside,
        link_new_into_place,
        lambda: _point_latest(save_dir, final),
        remove_the_rest,
    ]


def _rename(source: Path, destination: Path) -> None:
    """An atomic rename, on disk before the next step (the directory's entry fsynced)."""
    os.rename(source, destination)
    fsync_directory(destination.parent)


def _point_latest(save_dir: Path, target: Path) -> None:
    _write_json(save_dir / LATEST, target.name)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, destination)


def _settle(save_dir: Path) -> None:
    """Rank 0, before a save: finish a publish a crash interrupted, then drop the publish's leftovers."""
    named = latest_name(save_dir)
    match = CHECKPOINT_NAME.fullmatch(named or "")
    if named is not None and match is not None and match.group(1) == "tmp-" and is_complete(save_dir / named):
        rollout_id = int(match.group(2))
        log.warning("finishing the interrupted save of rollout %d (%s names %s)", rollout_id, LATEST, named)
        for step in publish_steps(save_dir, rollout_id):
            step()
    leftovers = [*save_dir.glob("old-*"), *save_dir.glob("staging-*")]
    named = latest_name(save_dir)
    if named is not None and is_complete(save_dir / named):
        # saves a crash abandoned (or the coordinator never published); kept while `latest` is broken, for a
        # person to look at
        leftovers += [tmp for tmp in save_dir.glob("tmp-*") if tmp.name != named]
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- loading


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


def load_model_weights(path: str | Path, model: Any) -> Path:
    """Load only the model weights of a rayless checkpoint into an unsharded `model` (the KL reference). A
    LoRA checkpoint holds the adapters alone: `model` then has the same adapters injected, and only they load
    (its base weights are the Hugging Face ones the adapters were trained on)."""
    directory = resolve_checkpoint(path)
    adapters = checkpoint_files.verify_checkpoint(directory, digests=False).lora is not None
    wanted = {k: v for k, v in model.state_dict().items() if not adapters or ".lora_" in k}
    state = {"model": wanted}
    _dcp_load(state, directory)
    model.load_state_dict(state["model"], strict=not adapters)
    return directory


def load_critic_weights(path: str | Path, model: Any) -> Path:
    """Collective: the critic weights of a rayless checkpoint into `model` (sharded or not; `--critic-load`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    directory = resolve_checkpoint(path)
    checkpoint_files.verify_checkpoint(directory, digests=False)
    if not (directory / CRITIC_SCHEDULER).is_file():
        raise CheckpointError(f"{directory} holds no critic (it was not saved by an --advantage-estimator ppo run)")
    state = {"critic": get_model_state_dict(model)}
    _dcp_load(state, directory)
    set_model_state_dict(model, state["critic"])
    return directory


def complete_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable weight AdamW's state, as AdamW starts it (step 0, zero moments), where it has none:
    a weight that never had a gradient yet (a VLM's tower after text-only steps, an expert no token was routed
    to) is stepped by AdamW exactly as if it had none. Without it the checkpoint lacks those entries while a
    fresh optimizer loading it expects one per weight (DCP initialises them all), and the resume fails."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state[parameter]
            if len(state) or not parameter.requires_grad:
                continue
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)


def _dcp_load(state: dict[str, Any], directory: Path) -> None:
    """DCP's load, its metadata and non-tensor values read without pickle (`checkpoint_files`)."""
    dcp.load(state, storage_reader=checkpoint_files.safe_reader(directory), planner=checkpoint_files.safe_planner())


def _options(model: Any) -> StateDictOptions:
    """Frozen parameters (a LoRA run's base weights) are not saved: they are the Hugging Face files'. So a
    checkpoint holds what trains (the adapters) and its optimizer state; loading leaves the frozen ones as
    they are, hence not strict."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _without_frozen(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """`state` less every frozen parameter, aliases included (DCP's option misses a tied lm_head.weight)."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {name: value for name, value in state.items() if name not in frozen} if frozen else state


def load_checkpoint(
    path: str | Path, *, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
    adapters: dict[str, Any] | None = None, step: int | None = None, critic: CriticState | None = None,
) -> LoadedCheckpoint:
    """Collective: restores model, optimizer, scheduler and this rank's RNG; returns the rollout id.
    adapters: this run's LoRA record (None: it trains the full model); the checkpoint's must be the same.
    The files are checked first (sizes and structure; the coordinator checked the digests before launch)."""
    directory = resolve_checkpoint(path, step)
    meta = checkpoint_files.verify_checkpoint(directory, digests=False)
    check_adapters(directory, meta.lora, adapters)
    options = _options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": _without_frozen(model, model_state), "optim": optim_state}
    if critic is not None:
        if not (directory / CRITIC_SCHEDULER).is_file():
            raise CheckpointError(f"{directory} holds no critic: this run trains one (--advantage-estimator ppo); "
                                  "resume a PPO run from its own checkpoints")
        state["critic"], state["critic_optim"] = get_state_dict(critic.model, critic.optimizer)
    _dcp_load(state, directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    scheduler.load_state_dict(read_json(directory / "scheduler.json", dict[str, Any]))
    if critic is not None:
        set_state_dict(critic.model, critic.optimizer, model_state_dict=state["critic"],
                       optim_state_dict=state["critic_optim"])
        critic.scheduler.load_state_dict(read_json(directory / CRITIC_SCHEDULER, dict[str, Any]))
    rng_file = directory / f"rng_rank{_rank()}.json"
    if rng_file.is_file():
        rng = read_json(rng_file, RngState)
        _set_rng_state({"torch": rng.torch, **({"cuda": rng.cuda} if rng.cuda is not None else {})})
    _barrier()
    return LoadedCheckpoint(rollout_id=meta.rollout_id, extra=dict(meta.extra), path=directory)
