"""The checkpoint slice: where training checkpoints go and come from, and the engines' weight snapshots.

Owns these flags, what `--load` and `--ref-load` name on disk (`resolve_load`, `resolve_ref_load`: a fresh
start, our checkpoint, a Hugging Face directory, or a Megatron one, which gets a message saying what to pass
instead; slime's rule: a directory without a checkpoint starts fresh) and where `--save-hf` writes
(`save_hf_path`: slime's and miles' `args.save_hf.format(rollout_id=...)`). Invariants: a save interval has a
directory to save to; a `--save-hf` template formats with `rollout_id` alone; every failure is a ConfigError
naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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

    def check(self) -> None:
        if self.save_interval is not None and self.save is None and self.save_hf is None:
            raise ConfigError("--save-interval needs --save DIR (or --save-hf DIR)")
        if self.save_retain_interval is not None and self.save is None:
            raise ConfigError("--save-retain-interval needs --save DIR")
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
    return (path / "extra.json").is_file() or (path / "latest").is_file()


@dataclass(frozen=True)
class LoadPlan:
    """What `--load` means for this run: resume from `path`, or start fresh (with the reason)."""

    resume: bool
    path: str | None = None
    fresh_reason: str | None = None


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
    if _is_rayless_checkpoint(path):
        return LoadPlan(resume=True, path=load)
    if _is_megatron_checkpoint(path):
        raise ConfigError(_megatron_message("--load", load))
    if _is_hf_dir(path):
        hf = hf_checkpoint
        if hf is not None and path.resolve() == Path(hf).resolve():
            return LoadPlan(resume=False, fresh_reason="is the --hf-checkpoint model")
        raise ConfigError(f"--load {load}: a Hugging Face model directory other than --hf-checkpoint {hf}: to "
                          "start training from it, pass it as --hf-checkpoint")
    return LoadPlan(resume=False, fresh_reason="holds no checkpoint yet")


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
