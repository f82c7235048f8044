"""What the ranks will train, known before any of them starts: the model built on the meta device.

Owns `check_trainable(config)`: the trainable parameter count — the full model's from the safetensors headers
(no model code imported), or with LoRA the `--hf-checkpoint` architecture instantiated without memory (meta
tensors, no weights read) and the `--lora-*` adapters injected as the ranks inject them. Invariant: with LoRA, every `--target-modules` name is checked against the real model here,
so a name the model lacks fails at start-up (exit 2) instead of on every rank after launch; so does a `--load`
checkpoint of other adapters (or of the full model under LoRA, and the reverse).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import msgspec

from coordinator.config.fields import ConfigError
from coordinator.config.settings import Config


def check_trainable(config: Config, *, always: bool = False) -> list[str]:
    """The trainable parameters' note; with LoRA, the targets checked. Without LoRA only when `always`
    (the dry run reports it; a real start need not build the model)."""
    if not config.needs_train_ranks:
        return []
    check_resume_adapters(config)
    if not (config.lora.enabled or always):
        return []
    model_dir = Path(str(config.rollout.hf_checkpoint))
    if not (model_dir / "config.json").is_file():
        return []  # check_paths says what is wrong with the directory
    if not config.lora.enabled:
        stored = stored_parameters(model_dir)  # the headers alone: no model import for the report
        if stored is not None:
            return [f"trainable parameters: {stored:,} (the full model)"]
    from coordinator.checks.architecture import meta_model

    try:
        model = meta_model(model_dir)
    except Exception as error:  # transformers raises many types for a config it cannot build
        why = f"{type(error).__name__}: {error}"
        if not config.lora.enabled:  # a count for the report only: the ranks say what fails, if anything
            return [f"trainable parameters: not counted (the model does not build here: {why})"]
        raise ConfigError(f"--hf-checkpoint {model_dir}: the model does not build, so --target-modules cannot be "
                          f"checked: {why}") from None
    total = sum(p.numel() for p in model.parameters())
    lora = config.lora.rank_lora(str(model_dir)) if config.lora.enabled else None
    if lora is None:
        return [f"trainable parameters: {total:,} (the full model)"]
    from workers.train_rank.lora import LoraError, apply_lora

    spec = msgspec.structs.replace(lora, adapter_path=None)  # the adapter file's weights load on the ranks
    try:
        apply_lora(model, spec)
    except LoraError as error:
        raise ConfigError(f"--target-modules: {error}") from None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapted = sum(1 for name, _ in model.named_modules() if name.endswith(".lora_A"))
    return [f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f}%): LoRA rank "
            f"{spec.rank}, alpha {spec.alpha:g} on {adapted} modules ({','.join(spec.target_modules)}); the "
            "engines get the merged weights"]


def check_resume_adapters(config: Config) -> None:
    """A `--load` checkpoint trained what this run trains: the full model, or the same adapters (the ranks
    check it again when they load)."""
    load = config.load_plan()
    if not load.resume or load.path is None:
        return
    from workers.train_rank import checkpoint_layout as checkpoint  # torch-free: a resume imports no torch

    directory = checkpoint.resolve_checkpoint(load.path)
    lora = config.lora.rank_lora(str(config.rollout.hf_checkpoint)) if config.lora.enabled else None
    current = lora.record() if lora is not None else None
    try:
        checkpoint.check_adapters(directory, checkpoint.checkpoint_adapters(directory), current)
    except checkpoint.CheckpointError as error:
        raise ConfigError(f"--load {load.path}: {error}") from None


#: a safetensors header larger than this is not read (a real one is a few MiB for the largest models)
MAX_HEADER_BYTES = 256 * 1024**2


def stored_parameters(model_dir: Path) -> int | None:
    """Elements of every tensor in the directory's safetensors files, read from their JSON headers (tied
    weights are stored once); None when it holds none or one is unreadable."""
    index = model_dir / "model.safetensors.index.json"
    try:
        names = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                 else ["model.safetensors"])
        total = 0
        for name in names:
            with (model_dir / Path(name).name).open("rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                if size > MAX_HEADER_BYTES:
                    return None
                header = json.loads(handle.read(size))
            total += sum(math.prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__")
        return total
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
