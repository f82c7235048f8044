"""What the run will read from disk, verified before any rank or engine starts: checkpoints, models, adapters.

Owns `check_disk(config)`, run by preflight after the paths and `--load` were resolved: the `--load` checkpoint
(its manifest's sizes and digests, DCP's metadata against its shards, the JSON files typed and bounded; a
damaged `latest` refused with the complete checkpoints and `--ckpt-step`), a `--ref-load` / teacher that is a
rayless checkpoint the same way, `--hf-checkpoint` and a Hugging Face `--ref-load` (every safetensors file
against its header; and, where the start-up builds the model on the meta device anyway — LoRA, `--dry-run` —
every parameter the architecture needs stored: missing keys are an error, not fresh weights; otherwise the
ranks and engines refuse missing keys as they load, which spares a plain start importing transformers here),
and `--lora-adapter-path` (its file against its header, its keys against the target modules).
`verify_reload(save_dir)` is the same check of the checkpoint a train-FT recovery is about to load.

Invariant: every failure is one `ConfigError` line naming the flag, the file and what is wrong (exit 2, nothing
launched); nothing is unpickled (`workers.train_rank.checkpoint_files`) and no tensor data is read but to
digest it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config


def check_disk(config: Config) -> list[str]:
    """Every check; a note per verified source (for `--dry-run`)."""
    from workers.train_rank.checkpoint_files import CheckpointError

    notes: list[str] = []
    flag = "--hf-checkpoint"
    try:
        if config.needs_train_ranks:
            load = config.load_plan()
            if load.resume and load.path is not None:
                flag = "--load"
                notes.append(f"--load: {verify_checkpoint_source(load.path)} verified (sizes, digests, metadata)")
            for flag, source in (("--ref-load", config.reference_path()),
                                 ("--opd-teacher-load", config.distill.teacher_path())):
                if source is not None:
                    notes.append(f"{flag}: {_verify_model_or_checkpoint(Path(source))} verified")
        flag = "--hf-checkpoint"
        model_dir = Path(str(config.rollout.hf_checkpoint))
        reads_weights = (config.needs_train_ranks or config.num_launched_rollout_engines > 0
                         or bool(config.eval.eval_num_engines))
        if reads_weights or _holds_weights(model_dir):
            architecture = config.lora.enabled or config.debug.dry_run  # the meta model is built anyway
            notes.append(f"--hf-checkpoint: {verify_model_dir(model_dir, architecture=architecture)}")
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


def verify_reload(save_dir: str | Path) -> Path:
    """Train FT: the checkpoint the restarted ranks are about to load, verified as at start-up (blocking:
    call it in a worker thread)."""
    return verify_checkpoint_source(save_dir)


def _verify_model_or_checkpoint(path: Path) -> str:
    if (path / "config.json").is_file():
        return verify_model_dir(path)
    return f"{verify_checkpoint_source(path)}"


def verify_model_dir(model_dir: Path, *, architecture: bool = False) -> str:
    """Every safetensors file of a Hugging Face directory against its header; with `architecture`, every
    parameter of the model its config.json describes stored (builds it on the meta device: imports
    transformers)."""
    from workers.train_rank.checkpoint_weights import missing_parameters, model_tensors

    tensors = model_tensors(model_dir)
    expected = _architecture(model_dir) if architecture else None
    if expected is not None:
        names, prefix, optional = expected
        missing = missing_parameters(names, set(tensors), prefix=prefix, optional=optional)
        if missing:
            from workers.train_rank.checkpoint_files import CheckpointError

            raise CheckpointError(f"{model_dir}: its safetensors files lack {len(missing)} of the model's "
                                  f"parameters, e.g. {', '.join(missing[:3])} (loading would fill them with fresh "
                                  "weights)")
    return f"{model_dir}: {len(tensors)} tensors, headers and sizes verified"


def _architecture(model_dir: Path) -> tuple[list[str], str, list[str]] | None:
    """(parameter names, base-model prefix, optional-name patterns) of the model `config.json` describes,
    built on the meta device (no memory, no weights); None when transformers cannot build it here (the ranks
    then say what fails)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        model_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(model_config)
    except Exception:  # transformers raises many types for a config it cannot build
        return None
    names = [name for name, _ in model.named_parameters()]  # tied weights once, as they are stored
    optional = [str(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    return names, str(getattr(model, "base_model_prefix", "") or ""), optional


def verify_adapter(config: Config, adapter_dir: Path) -> str:
    """`adapter_model.safetensors` against its header; its keys are LoRA weights of the target modules."""
    from workers.train_rank.checkpoint_weights import check_adapter_keys, check_safetensors

    path = adapter_dir / "adapter_model.safetensors"
    if not path.is_file():
        from workers.train_rank.checkpoint_files import CheckpointError

        raise CheckpointError(f"{path}: missing")
    tensors = check_safetensors(path)
    lora = config.lora.rank_lora(str(config.rollout.hf_checkpoint))
    check_adapter_keys(path, tensors, list(lora.target_modules) if lora is not None else [])
    return f"{path}: {len(tensors)} adapter tensors verified"
