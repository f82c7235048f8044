"""What the run will read from disk, verified before any rank or engine starts: checkpoints, models, adapters.

Owns `check_disk(config)`, run by preflight after the paths and `--load` were resolved: the `--load` checkpoint
(its manifest's sizes and digests, DCP's metadata against its shards, the JSON files typed and bounded, a full
model's tensor shapes against `--hf-checkpoint`'s verified safetensors headers, torch-free; a damaged `latest`
refused with the complete checkpoints and `--ckpt-step`), a `--ref-load` / teacher that is a rayless checkpoint
the same way,
`--hf-checkpoint` and a Hugging Face `--ref-load` / teacher (its `manifest.json` when it has one — a `--save-hf`
or `rayless export` directory; every safetensors file against its header; every parameter the architecture needs
stored with its shape, `coordinator.checks.architecture`: missing keys are an error, not fresh weights), and
`--lora-adapter-path` (its file against its header, its keys against the target modules).
`verify_reload(save_dir)` is the same check of the checkpoint a train-FT recovery is about to load.

Invariant: every failure is one `ConfigError` line naming the flag, the file and what is wrong (exit 2, nothing
launched); nothing is unpickled but through the allow-list (`workers.boundary.dcp_metadata`, whose records a
resume's checks read: they import no torch) and no tensor data is read but to digest it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config


def check_disk(config: Config) -> list[str]:
    """Every check; a note per verified source (for `--dry-run`)."""
    from workers.train_rank.checkpoint_files import CheckpointError

    notes: list[str] = []
    flag = "--hf-checkpoint"
    resumed: Path | None = None
    try:
        if config.needs_train_ranks:
            load = config.load_plan()
            if load.resume and load.path is not None:
                flag = "--load"
                resumed = verify_checkpoint_source(load.path)
                notes.append(f"--load: {resumed} verified (sizes, digests, metadata)")
            for flag, source in (("--ref-load", config.reference_path()),
                                 ("--opd-teacher-load", config.distill.teacher_path())):
                if source is not None:
                    notes.append(f"{flag}: {_verify_model_or_checkpoint(Path(source))} verified")
        flag = "--hf-checkpoint"
        model_dir = Path(str(config.rollout.hf_checkpoint))
        reads_weights = (config.needs_train_ranks or config.num_launched_rollout_engines > 0
                         or bool(config.eval.eval_num_engines))
        if reads_weights or _holds_weights(model_dir):
            notes.append(f"--hf-checkpoint: {verify_model_dir(model_dir, architecture=reads_weights)}")
        if resumed is not None:  # after the model's own check: its headers are what the checkpoint is held to
            flag = "--load"
            notes += _checkpoint_fits_model(resumed, model_dir)
        adapter = config.lora.lora_adapter_path
        if adapter is not None:
            flag = "--lora-adapter-path"
            notes.append(f"--lora-adapter-path: {verify_adapter(config, Path(adapter))}")
    except CheckpointError as error:
        raise ConfigError(f"{flag}: {error}") from None
    return notes


def _holds_weights(model_dir: Path) -> bool:
    """Whether the directory has weight files (a run on attached engines alone may pass a tokenizer-only one)."""
    return any(model_dir.glob("*.safetensors")) or (model_dir / "model.safetensors.index.json").exists()


def verify_checkpoint_source(path: str | Path, step: int | None = None) -> Path:
    """The checkpoint `path` resolves to (a save dir's `latest`, or `rollout_<step>`), verified whole."""
    from workers.train_rank.checkpoint_files import verify_checkpoint
    from workers.train_rank.checkpoint_layout import resolve_checkpoint  # torch-free, as checkpoint_files

    directory = resolve_checkpoint(path, step)
    verify_checkpoint(directory)
    return directory


def _checkpoint_fits_model(directory: Path, model_dir: Path) -> list[str]:
    """A full-model checkpoint's tensors have the shapes of the model the ranks build (LoRA checkpoints hold
    adapters, which `check_trainable` holds to the targets). Torch-free: the metadata's records against the
    model's safetensors headers."""
    from workers.boundary.dcp_metadata import read_dcp_metadata
    from workers.train_rank.checkpoint_files import Extra, read_json

    if read_json(directory / "extra.json", Extra).lora is not None or not (model_dir / "config.json").is_file():
        return []
    from coordinator.checks.architecture import check_checkpoint_shapes

    return [f"--load: {check_checkpoint_shapes(model_dir, read_dcp_metadata(directory), directory)}"]


def verify_reload(save_dir: str | Path) -> Path:
    """Train FT: the checkpoint the restarted ranks are about to load, verified as at start-up (blocking:
    call it in a worker thread)."""
    return verify_checkpoint_source(save_dir)


def _verify_model_or_checkpoint(path: Path) -> str:
    if (path / "config.json").is_file():
        return verify_model_dir(path)
    return f"{verify_checkpoint_source(path)}"


def verify_model_dir(model_dir: Path, *, architecture: bool = True) -> str:
    """A Hugging Face directory: its manifest when it has one (`--save-hf`, `rayless export`, a weight snapshot:
    every file's size and digest), every safetensors file against its header, and with `architecture` every
    parameter of the model its config.json describes stored with its shape (`coordinator.checks.architecture`)."""
    from workers.boundary.manifest import MANIFEST, check_manifest, hub_cache_root
    from workers.train_rank.checkpoint_files import read_json
    from workers.train_rank.checkpoint_weights import model_tensors

    read_json(model_dir / "config.json", dict[str, Any])  # bounded and typed: garbage is named, not a traceback
    notes = []
    if (model_dir / MANIFEST).is_file():
        check_manifest(model_dir, links_within=hub_cache_root(model_dir))
        notes.append(f"{MANIFEST}'s sizes and digests")
    files: dict[str, Path] = {}
    tensors = model_tensors(model_dir, files)
    notes.append("headers and sizes")
    if architecture:
        from coordinator.checks.architecture import check_coverage

        notes.append(check_coverage(model_dir, tensors, files))
    return f"{model_dir}: {len(tensors)} tensors; verified: {'; '.join(notes)}"


def verify_adapter(config: Config, adapter_dir: Path) -> str:
    """`adapter_model.safetensors` against its header (and the directory's manifest when rayless wrote it); its
    keys are LoRA weights of the target modules, their shapes those of the model's layers at the rank."""
    from workers.boundary.manifest import MANIFEST, check_manifest
    from workers.train_rank.checkpoint_weights import check_adapter_keys, check_safetensors

    path = adapter_dir / "adapter_model.safetensors"
    if (adapter_dir / MANIFEST).is_file():
        check_manifest(adapter_dir)
    if not path.is_file():
        from workers.train_rank.checkpoint_files import CheckpointError

        raise CheckpointError(f"{path}: missing")
    tensors = check_safetensors(path)
    model_dir = Path(str(config.rollout.hf_checkpoint))
    lora = config.lora.rank_lora(str(model_dir))
    check_adapter_keys(path, tensors, list(lora.target_modules) if lora is not None else [])
    shapes = ""
    if lora is not None and (model_dir / "config.json").is_file():
        from coordinator.checks.architecture import check_adapter_shapes

        shapes = f"; {check_adapter_shapes(model_dir, tensors, path, lora.rank)}"
    return f"{path}: {len(tensors)} adapter tensors verified{shapes}"
