"""The checkpoint slice: where training checkpoints go and come from, and the engines' weight snapshots.

Owns these flags, what `--load` and `--ref-load` name on disk (`resolve_load`, `resolve_ref_load`: a fresh
start, our checkpoint — a save directory or one `rollout_<id>` in it —, a run directory, which resumes from the
checkpoint its run saved (its config.json's `--save`), a Hugging Face directory, or a Megatron one, which gets a
message saying what to pass instead; slime's rule: a directory without a checkpoint starts fresh), which rollout
a checkpoint holds (`checkpoint_rollout`, read without torch) and where `--save-hf` writes (`save_hf_path`:
slime's and miles' `args.save_hf.format(rollout_id=...)`). Invariants: a save interval has a directory to save
to; a `--save-hf` template formats with `rollout_id` alone; every failure is a ConfigError naming the flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    save_hf: str | None = flag(None, help="at each save (--save-interval, and the last rollout) also write a "
                               "Hugging Face model directory here; {rollout_id} in it is the rollout saved, as "
                               "slime; a LoRA run's holds the merged weights and the adapter in adapter/",
                               metavar="DIR")
    keep_weight_snapshots: int = flag(2, help="weight snapshots for engines kept on disk", minimum=1)
    ckpt_step: int | None = flag(None, help="with --load of a save directory: resume from its rollout_N, not the "
                                 "one `latest` names (Megatron's --ckpt-step)", minimum=0)

    def check(self) -> None:
        if self.save_interval is not None and self.save is None and self.save_hf is None:
            raise ConfigError("--save-interval needs --save DIR (or --save-hf DIR)")
        if self.save_retain_interval is not None and self.save is None:
            raise ConfigError("--save-retain-interval needs --save DIR")
        if self.ckpt_step is not None and self.load is None:
            raise ConfigError("--ckpt-step needs --load DIR (the save directory to take the step from)")
        if self.save_hf is not None:
            save_hf_path(self.save_hf, 0)  # a template that cannot be formatted fails now, not at the first save

    @property
    def saves(self) -> bool:
        """Whether the run saves at all: a checkpoint (--save), a Hugging Face directory (--save-hf), or both."""
        return self.save is not None or self.save_hf is not None


def save_hf_path(template: str, rollout_id: int) -> str:
    """`--save-hf`'s directory for one save: `template.format(rollout_id=...)`, as slime and miles format it (a
    template without `{rollout_id}` is the same directory at every save, replaced each time)."""
    try:
        path = template.format(rollout_id=rollout_id)
    except KeyError as error:
        raise ConfigError(f"--save-hf {template}: {{{error.args[0]}}} is not a field of the path; the only one is "
                          "{rollout_id} (write a literal brace as {{ or }})") from None
    except IndexError:
        raise ConfigError(f"--save-hf {template}: a positional field ({{}} or {{0}}); the only field is "
                          "{rollout_id} (write a literal brace as {{ or }})") from None
    except (ValueError, AttributeError) as error:
        raise ConfigError(f"--save-hf {template}: not a format string ({error}); the only field is {{rollout_id}} "
                          "(write a literal brace as {{ or }})") from None
    if not path:
        raise ConfigError("--save-hf: an empty path")
    return path


# ---------------------------------------------------------------------------------------------------------
# --load and --ref-load on disk
# ---------------------------------------------------------------------------------------------------------
def _is_megatron_checkpoint(path: Path) -> bool:
    return ((path / "latest_checkpointed_iteration.txt").is_file() or (path / ".metadata").is_file()
            or any(child.name.startswith("iter_") for child in path.iterdir() if child.is_dir()))


def _megatron_message(flag: str, path: str) -> str:
    return (f"{flag} {path}: a Megatron-LM checkpoint (torch_dist), which rayless cannot read: pass the Hugging "
            "Face model directory it was converted from (the one --hf-checkpoint names) or a rayless checkpoint "
            "directory; to continue a Megatron run, convert it to Hugging Face format first (slime's "
            "tools/convert_torch_dist_to_hf.py)")


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def _is_rayless_checkpoint(path: Path) -> bool:
    # a save dir whose `latest` is gone still holds checkpoints: resumed (and refused with the choices), never
    # silently started fresh over them
    return ((path / "extra.json").is_file() or (path / "latest").is_file()
            or any((child / "extra.json").is_file() for child in path.glob("rollout_*")))


#: a run directory's record of its config (`write_resolved_config`) and what only a run directory holds
RUN_CONFIG = "config.json"
RUN_FILES = ("metrics.jsonl", "status.json", "summary.json", "plan.txt")
_CHECKPOINT_NAME = re.compile(r"(?:rollout_|tmp-)(\d+)")
#: a config.json larger than this is not a run's (a run's is a few KB)
_MAX_RUN_CONFIG_BYTES = 4 << 20


def run_config(path: Path) -> dict[str, Any] | None:
    """The resolved config a run directory holds (its config.json), or None when `path` is not a run directory
    (a Hugging Face model's config.json has no `run_dir`)."""
    from workers.boundary.errors import BoundaryError
    from workers.boundary.json_input import JsonLimits, decode_json

    file = path / RUN_CONFIG
    try:
        if file.stat().st_size > _MAX_RUN_CONFIG_BYTES:
            return None
        data = decode_json(file.read_bytes(), str(file), JsonLimits(max_bytes=_MAX_RUN_CONFIG_BYTES))
    except (OSError, BoundaryError):
        return None
    if isinstance(data, dict) and "run_dir" in data and "hf_checkpoint" in data and "model_type" not in data:
        return data
    return None


def is_run_dir(path: Path) -> bool:
    return run_config(path) is not None or any((path / name).is_file() for name in RUN_FILES)


def _small_json(file: Path) -> Any:
    """A checkpoint's `extra.json` or `latest`, decoded within small bounds; None when it cannot be read or
    decoded (a garbage or 100k-deep file is "no checkpoint" here; `check_disk` says what is wrong with it)."""
    from workers.boundary.json_input import JsonLimits, decode_json

    try:
        with file.open("rb") as handle:
            raw = handle.read(_MAX_RUN_CONFIG_BYTES + 1)
        return decode_json(raw, str(file), JsonLimits(max_bytes=_MAX_RUN_CONFIG_BYTES, max_depth=32))
    except (OSError, ValueError):  # BoundaryError is a ValueError
        return None


def checkpoint_rollout(path: Path) -> int | None:
    """The rollout id of the checkpoint `path` holds (a `rollout_<id>` directory, or a save directory: the one
    `latest` names, else its newest complete one), or None when it holds none. Read from the files alone."""
    def complete_id(directory: Path) -> int | None:
        if not (directory / ".metadata").is_file():
            return None
        meta = _small_json(directory / "extra.json")
        value = meta.get("rollout_id") if isinstance(meta, dict) else None
        return value if type(value) is int else None

    if not path.is_dir():
        return None
    own = complete_id(path)
    if own is not None:
        return own
    named = _small_json(path / "latest")
    if isinstance(named, str) and "/" not in named and named not in ("", ".", ".."):
        found = complete_id(path / named)
        if found is not None:
            return found
    ids = [complete_id(child) for child in path.iterdir() if _CHECKPOINT_NAME.fullmatch(child.name)]
    return max((i for i in ids if i is not None), default=None)


@dataclass(frozen=True)
class LoadPlan:
    """What `--load` means for this run: resume from `path`, or start fresh (with the reason)."""

    resume: bool
    path: str | None = None
    fresh_reason: str | None = None
    #: `--load` named a run directory; `path` is the checkpoint directory its run saved to
    run_dir: str | None = None


def resolve_load(checkpoint: CheckpointConfig, *, hf_checkpoint: str | None) -> LoadPlan:
    """slime's rule: `--load` of a directory that does not exist yet, or holds no checkpoint, starts fresh (from
    --hf-checkpoint here); our checkpoint resumes; the --hf-checkpoint directory itself starts fresh from it."""
    load = checkpoint.load
    if load is None:
        return LoadPlan(resume=False)
    path = Path(load)
    if not path.exists():
        return LoadPlan(resume=False, fresh_reason="does not exist yet")
    if not path.is_dir():
        raise ConfigError(f"--load {load}: not a directory")
    if checkpoint.ckpt_step is not None:
        return _load_step(load, checkpoint.ckpt_step)
    if _is_rayless_checkpoint(path):
        return LoadPlan(resume=True, path=load)
    if is_run_dir(path):
        return _load_of_run_dir(load, path)
    if _is_megatron_checkpoint(path):
        raise ConfigError(_megatron_message("--load", load))
    if _is_hf_dir(path):
        hf = hf_checkpoint
        if hf is not None and path.resolve() == Path(hf).resolve():
            return LoadPlan(resume=False, fresh_reason="is the --hf-checkpoint model")
        raise ConfigError(f"--load {load}: a Hugging Face model directory other than --hf-checkpoint {hf}: to "
                          "start training from it, pass it as --hf-checkpoint")
    return LoadPlan(resume=False, fresh_reason="holds no checkpoint yet")


def _load_step(load: str, step: int) -> LoadPlan:
    """`--load DIR --ckpt-step N`: DIR's `rollout_N` (whatever `latest` says); a step it lacks is an error."""
    chosen = Path(load) / f"rollout_{step}"
    if not (chosen / "extra.json").is_file():
        held = sorted(int(p.name.removeprefix("rollout_")) for p in Path(load).glob("rollout_*")
                      if p.name.removeprefix("rollout_").isdigit() and (p / "extra.json").is_file())
        raise ConfigError(f"--ckpt-step {step}: --load {load} holds no checkpoint rollout_{step} (it holds: "
                          f"{', '.join(map(str, held)) or 'none'})")
    return LoadPlan(resume=True, path=str(chosen))


def _load_of_run_dir(load: str, path: Path) -> LoadPlan:
    """`--load RUN_DIR`: resume from the checkpoint that run saved (its `--save` directory)."""
    recorded = run_config(path) or {}
    save = recorded.get("save")
    if not isinstance(save, str) or not save:
        raise ConfigError(f"--load {load}: a run directory whose run saved no checkpoint (it ran without --save), "
                          "so there is nothing to resume from; start a new run (a new --run-dir, or "
                          "--overwrite-run-dir), with --save DIR to make it resumable")
    if checkpoint_rollout(Path(save)) is None:
        raise ConfigError(f"--load {load}: a run directory; its run saves to --save {save}, which holds no "
                          "checkpoint (yet): nothing to resume from (run from the directory that run was started "
                          "in, if --save was a relative path)")
    return LoadPlan(resume=True, path=save, run_dir=load)


def resolve_ref_load(checkpoint: CheckpointConfig, *, use_kl_loss: bool) -> str | None:
    """The reference model's source for the ranks (None: --hf-checkpoint). Checked only when the run loads a
    reference (`--use-kl-loss`), as slime."""
    ref = checkpoint.ref_load
    if ref is None or not use_kl_loss:
        return None
    path = Path(ref)
    if not path.is_dir():
        raise ConfigError(f"--ref-load {ref}: no such directory (the reference model of --use-kl-loss)")
    if _is_hf_dir(path) or _is_rayless_checkpoint(path):
        return ref
    if _is_megatron_checkpoint(path):
        raise ConfigError(_megatron_message("--ref-load", ref))
    raise ConfigError(f"--ref-load {ref}: neither a Hugging Face model directory (config.json) nor a rayless "
                      "checkpoint")
