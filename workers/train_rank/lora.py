"""LoRA on the rank: peft adapters injected into the Hugging Face model, and the merged weights engines load.

Owns `apply_lora` (peft's `inject_adapter_in_model`, with the `LoraSettings` the coordinator resolved from
`--lora-*` / `--target-modules`: the model keeps its class and names, each targeted Linear becomes `<name>.base_layer` + `<name>.lora_A/B.default`, and only the adapters require grad), and
`engine_tensors`: the (name, tensor) list an engine loads, under the plain model's names, with each adapted
weight given as `MergedWeight` (base + scaling · B · A, computed when gathered).

Invariants: the engine always receives a plain model's state dict (no `base_layer`, no `lora_` names), equal
to the training forward with dropout off; frozen base weights are never trained nor held by the optimizer (the
optimizer takes the parameters that require grad); merging never writes into the base weights, so training
goes on from exactly the state it had.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from workers.protocol.train_settings import LoraSettings
from workers.train_rank.model import tied_parameter_names

ADAPTER_NAME = "default"  # peft's name of the one adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the Hugging Face PEFT format (`save_pretrained`)
ADAPTER_CONFIG = "adapter_config.json"
#: where a checkpoint, a `--save-hf` directory and `rayless export` put the adapter (miles' place for --save-hf)
ADAPTER_DIR = "adapter"


class LoraError(ValueError):
    """Adapter settings or an adapter file the model cannot take."""


def peft_config(spec: LoraSettings) -> Any:
    try:
        from peft import LoraConfig
    except ImportError as exc:
        raise LoraError("LoRA (--lora-rank) needs the peft package: pip install 'rayless[lora]'") from exc
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=list(spec.target_modules), exclude_modules=list(spec.exclude_modules) or None,
                      bias="none")


def linear_leaf_names(model: Any) -> set[str]:
    """The last name component of every Linear in the model (what a target module names)."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name}


def check_targets(model: Any, spec: LoraSettings) -> None:
    """Each target names a Linear of the model, and none is tied to the embeddings (its merge would be lost)."""
    leaves = linear_leaf_names(model)
    missing = sorted(set(spec.target_modules) - leaves)
    if missing:
        raise LoraError(f"target modules {missing} are not Linear modules of {type(model).__name__}; its Linear "
                        f"modules are {sorted(leaves)}")
    tied = {name.removesuffix(".weight") for name in tied_parameter_names(model)}
    adapted_tied = sorted(leaf for leaf in spec.target_modules if any(t.rsplit(".", 1)[-1] == leaf for t in tied))
    if adapted_tied:
        raise LoraError(f"target modules {adapted_tied} share their weight with the embeddings "
                        "(tie_word_embeddings): an adapter there cannot be merged into one tensor; drop them")


def inject_lora(model: Any, spec: LoraSettings) -> None:
    """Inject the adapters in place (B = 0: the model's function is unchanged until it trains) and freeze the
    rest; on a meta-device model this gives the structure only (the sharded load fills the weights)."""
    check_targets(model, spec)
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config(spec), model, adapter_name=ADAPTER_NAME)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_" in name)


def apply_lora(model: Any, spec: LoraSettings) -> None:
    """`inject_lora`, then `spec.adapter_path`'s weights when given."""
    inject_lora(model, spec)
    if spec.adapter_path is not None:
        load_adapter_weights(model, Path(spec.adapter_path))


@contextlib.contextmanager
def dropout_off(model: Any) -> Iterator[None]:
    """Forward-only passes (the old logprobs) in eval mode, as miles' `forward_only`: with `--lora-dropout`
    the ratio's denominator is then the policy itself, not one dropout draw of it."""
    was_training = bool(model.training)
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def lora_layers(model: Any) -> dict[str, Any]:
    """Module name → peft LoRA layer (duck-typed: a base layer and lora_A), in module order."""
    return {name: module for name, module in model.named_modules()
            if hasattr(module, "base_layer") and hasattr(module, "lora_A")}


def has_adapters(model: Any) -> bool:
    return any(".lora_" in name for name, _ in model.named_parameters())


def adapter_parameters(model: Any) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if ".lora_" in name}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # An FSDP2 DTensor gathers its shards (collective: every rank calls this in the same order).
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach()


class MergedWeight:
    """An adapted Linear's weight as the engine loads it: base + scaling · B · A, built by `full_tensor()`.

    Quacks as far as the weight transfer needs (`dtype`, `shape`, `numel`, `element_size`, `full_tensor`), so
    the bucket plan and the gathers treat it as any other tensor; the merge happens per bucket, never for the
    whole model at once."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        base = layer.base_layer.weight
        self.dtype: torch.dtype = base.dtype
        self.shape = torch.Size(base.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def full_tensor(self) -> torch.Tensor:
        layer = self.layer
        base = _full(layer.base_layer.weight)
        a = _full(layer.lora_A[ADAPTER_NAME].weight)
        b = _full(layer.lora_B[ADAPTER_NAME].weight)
        delta = (b.float() @ a.float()) * float(layer.scaling[ADAPTER_NAME])
        if getattr(layer, "fan_in_fan_out", False):
            delta = delta.T
        return (base.float() + delta).to(base.dtype)


def engine_tensors(model: Any) -> list[tuple[str, Any]]:
    """(name, tensor or MergedWeight) of everything an engine loads, under the plain model's names, in
    state-dict order, tied aliases dropped. FSDP2 gives sharded DTensors here (gathered by the caller)."""
    layers = lora_layers(model)
    tied = tied_parameter_names(model)
    out: list[tuple[str, Any]] = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        prefix, _, leaf = name.rpartition(".")
        owner = prefix.removesuffix(".base_layer") if prefix.endswith(".base_layer") else None
        if owner is not None and owner in layers:
            plain = f"{owner}.{leaf}"
            entry: Any = MergedWeight(layers[owner]) if leaf == "weight" else tensor.detach()
        elif ".lora_" in name:
            continue  # the adapters themselves: merged above
        else:
            plain, entry = name, tensor.detach()
        if plain not in tied:
            out.append((plain, entry))
    return out


def trainable_counts(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter elements, each shared tensor once."""
    parameters = list(model.parameters())
    return sum(p.numel() for p in parameters if p.requires_grad), sum(p.numel() for p in parameters)


# ------------------------------------------------------------------------------ HF PEFT adapter files


_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+\.lora_[AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


def load_adapter_weights(model: Any, directory: Path) -> None:
    """Load an adapter saved in the Hugging Face PEFT format (`adapter_model.safetensors`; a pickled
    `adapter_model.bin` is refused: never unpickle untrusted data) into the injected adapters."""
    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        found = "adapter_model.bin (pickle, refused)" if (directory / "adapter_model.bin").is_file() else "none"
        raise LoraError(f"--lora-adapter-path {directory}: no {ADAPTER_WEIGHTS} there (found: {found})")
    from safetensors.torch import load_file

    params = adapter_parameters(model)
    loaded: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(str(path)).items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise LoraError(f"--lora-adapter-path {path}: {key!r} is not a LoRA A/B weight")
        name = f"{match.group(1)}.{ADAPTER_NAME}.weight"
        if name not in params:
            raise LoraError(f"--lora-adapter-path {path}: {key!r} has no adapter here (check --target-modules)")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise LoraError(f"--lora-adapter-path {path}: {key!r} has shape {tuple(tensor.shape)}, the adapter "
                            f"here {tuple(params[name].shape)} (check --lora-rank)")
        loaded[name] = tensor
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise LoraError(f"--lora-adapter-path {path}: no weights for {len(missing)} adapters, e.g. {missing[0]}")
    with torch.no_grad():
        for name, tensor in loaded.items():
            params[name].copy_(tensor.to(params[name].dtype))


def write_adapter(model: Any, spec: LoraSettings, directory: Path, *, base_model_path: str, write: bool) -> None:
    """The adapters in the Hugging Face PEFT format (for `--lora-adapter-path`, peft's `from_pretrained`,
    SGLang's `--lora-paths`). Collective under FSDP (every rank gathers); only the rank with `write` writes."""
    state = adapter_state(model)
    if write:
        write_adapter_files(state, spec, directory, base_model_path=base_model_path)


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's file names, whole on the CPU. Collective under FSDP (every rank gathers)."""
    return {"base_model.model." + name.replace(f".{ADAPTER_NAME}.weight", ".weight"): _full(p).cpu()
            for name, p in adapter_parameters(model).items()}


def write_adapter_files(state: dict[str, torch.Tensor], spec: LoraSettings, directory: Path, *,
                        base_model_path: str) -> None:
    """`adapter_model.safetensors` and `adapter_config.json` of `adapter_state`'s tensors in `directory`, then
    its `manifest.json` (sizes and digests)."""
    from workers.train_rank.tensor_files import write_safetensors

    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(state, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
              "target_modules": sorted(spec.target_modules), "exclude_modules": sorted(spec.exclude_modules) or None,
              "bias": "none", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path}
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    from workers.boundary.manifest import write_manifest

    write_manifest(directory)  # last: what `--lora-adapter-path` checks before this adapter is loaded again
