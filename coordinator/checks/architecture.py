"""A model directory's weights against the architecture its `config.json` describes, before any rank starts.

Owns `check_coverage(model_dir, stored, files)`: the model built on the meta device (no memory, no weights read)
and every entry of its state dict matched against the tensors the directory stores — through transformers' own
key renamings and converters (`conversion_mapping`: old checkpoint names, an MoE's per-expert tensors fused as
they load), the base-model prefix either way, and tied weights (a tied `lm_head.weight` is covered by its source,
or the reverse). A parameter none of whose names is stored is missing (transformers would fill it with fresh
weights); a stored tensor whose shape differs from the model's, or an integer tensor where the model holds
floats, is refused. `check_checkpoint_shapes(model_dir, meta, checkpoint)` holds a full-model DCP checkpoint's
tensors (`--load`) to the shapes and floating-point kinds of the same-named tensors of the directory's
safetensors headers — which `check_coverage` holds to the architecture — without torch: a resume builds no
model; `check_adapter_shapes` a PEFT adapter's LoRA weights to the model's linear layers at its rank.

Cost: building the meta model imports torch and transformers' modeling code — measured ~1.7 s here on top of
the ~2.8 s torch + tokenizer import every `rayless train` pays anyway when it loads the tokenizer (the checks
are lazily imported: importing `coordinator` still imports no torch). A pass is remembered under
`$RAYLESS_CACHE_DIR/architecture-ok/` (default `~/.cache/rayless`, or `$XDG_CACHE_HOME/rayless`), keyed by the
xxh3-128 of its config.json, the checked tensors' names, dtypes and shapes, and the torch and transformers
versions, so a start from weights already checked imports nothing here; only passes (and a config transformers
does not build here, keyed by config.json and the versions) are remembered, so a refused directory is built and
refused anew.

Invariant: a failure is a `CheckpointError` naming the file and what is wrong (the first missing names and how
many); a config transformers cannot build here is not refused (the ranks say what fails), and said so in the
note; there is no flag for a new head: rayless trains no value head (`--advantage-estimator ppo` is refused).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.boundary.manifest import CheckpointError
from workers.vlm_processor import vlm_model_type

if TYPE_CHECKING:
    from workers.boundary.dcp_metadata import Metadata

#: bumped when what a pass means changes, so older remembered passes stop counting
_CHECK_VERSION = 1
_SHOWN = 5


def cache_dir() -> Path:
    """`$RAYLESS_CACHE_DIR`, else `$XDG_CACHE_HOME/rayless`, else `~/.cache/rayless`; passes in `architecture-ok/`."""
    base = os.environ.get("RAYLESS_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rayless")
    return Path(base) / "architecture-ok"


def _cache_key(model_dir: Path, kind: str, entries: list[str]) -> str | None:
    """What a pass depends on: the check, config.json, the checked tensors' names, dtypes and shapes, and the
    libraries that build the model (None when one cannot be read: then nothing is remembered)."""
    import xxhash

    try:
        config = (model_dir / "config.json").read_bytes()
        versions = [importlib.metadata.version(name) for name in ("torch", "transformers")]
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    hasher = xxhash.xxh3_128()
    for part in (str(_CHECK_VERSION), kind, *versions, str(len(config))):
        hasher.update(part.encode() + b"\0")
    hasher.update(config)
    for entry in sorted(entries):
        hasher.update(entry.encode() + b"\0")
    return hasher.hexdigest()


def _passed_before(key: str | None) -> bool:
    return key is not None and (cache_dir() / key).is_file()


def _remember(key: str | None) -> None:
    """An empty file per pass (a write that fails only costs the next start the build)."""
    if key is None:
        return
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / key).touch()
    except OSError:
        pass


def meta_model(model_dir: Path) -> Any:
    """The model `config.json` describes, on the meta device (no memory, no weights read), of the class the ranks
    load (`workers.train_rank.model`: a vision-language model's own, with its vision tower); raises what
    transformers raises for a config it cannot build."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    model_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    model_class = AutoModelForImageTextToText if vlm_model_type(model_dir) else AutoModelForCausalLM
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # architecture notes of transformers; the ranks log them
        return model_class.from_config(model_config)


def build_meta_model(model_dir: Path) -> Any | None:
    """`meta_model`, or None when transformers cannot build it here."""
    try:
        return meta_model(model_dir)
    except Exception:  # transformers raises many types for a config it cannot build
        return None


def check_coverage(model_dir: Path, stored: Mapping[str, tuple[str, tuple[int, ...]]],
                   files: Mapping[str, Path]) -> str:
    """Every entry of the architecture's state dict stored, with its shape (see the module doc); a note of what
    was checked. `stored`: name → (safetensors dtype, shape); `files`: name → the file holding it."""
    key = _cache_key(model_dir, "coverage", [f"{n}:{d}:{list(shape)}" for n, (d, shape) in stored.items()])
    if _passed_before(key):
        return "every parameter of the architecture stored (passed before with these weights)"
    # whether transformers builds it depends on config.json and the versions only: an unbuildable directory
    # (a vision-language model AutoModelForCausalLM does not take) is remembered too, so its next start skips the
    # torch import this check would cost for nothing
    if vlm_model_type(model_dir):
        return ("the architecture was not checked (a vision-language model: transformers renames its stored tensors "
                "as it loads them; the ranks will)")
    unbuildable = _cache_key(model_dir, "coverage-unbuildable", [])
    if _passed_before(unbuildable):
        return "the architecture was not checked (transformers does not build it here, as an earlier start found; " \
               "the ranks will)"
    model = build_meta_model(model_dir)
    if model is None:
        _remember(unbuildable)
        return "the architecture was not checked (transformers does not build it here; the ranks will)"
    missing, wrong = _compare(model, stored, files)
    where = _weights_name(model_dir, files)
    if missing:
        shown = ", ".join(missing[:_SHOWN]) + (", ..." if len(missing) > _SHOWN else "")
        raise CheckpointError(f"{where}: lacks {len(missing)} of the {len(model.state_dict())} tensors the model's "
                              f"config.json needs: {shown} (loading would fill them with fresh weights)")
    if wrong:
        raise CheckpointError(wrong[0])
    _remember(key)
    return "every parameter of the architecture stored, shapes as config.json says"


def _weights_name(model_dir: Path, files: Mapping[str, Path]) -> Path:
    names = {path.name for path in files.values()}
    if len(names) == 1:
        return model_dir / names.pop()
    return model_dir / "model.safetensors.index.json" if (model_dir / "model.safetensors.index.json").is_file() \
        else model_dir


def _compare(model: Any, stored: Mapping[str, tuple[str, tuple[int, ...]]],
             files: Mapping[str, Path]) -> tuple[list[str], list[str]]:
    """(missing names of the model's state dict, one line per stored tensor of the wrong shape or kind)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    expected = model.state_dict()
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None
    covered: set[str] = set()
    converted_targets: list[re.Pattern[str]] = []
    wrong: list[str] = []
    for name, (dtype, shape) in stored.items():
        target, pattern = rename_source_key(name, renamings, converters, prefix, expected)
        covered.add(target)
        if pattern is not None:  # fused or split as it loads: its shape is the converter's business
            converter = next(c for c in converters if pattern in c.source_patterns)
            converted_targets += [_glob(p) for p in converter.target_patterns]
            continue
        tensor = expected.get(target)
        if tensor is None:
            continue  # unexpected keys are dropped by transformers (e.g. an old rotary inv_freq)
        if tuple(tensor.shape) != tuple(shape):
            wrong.append(f"{files[name]}: tensor {name} is {list(shape)}, the model's config.json needs "
                         f"{list(tensor.shape)}")
        elif tensor.is_floating_point() and not (dtype.startswith(("F", "BF"))):
            wrong.append(f"{files[name]}: tensor {name} is {dtype}, the model holds floating-point weights there")
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    optional = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    missing = []
    for name in expected:
        if name in covered or tied.get(name) in covered or any(t in covered for t, s in tied.items() if s == name):
            continue  # a tied pair is loaded from whichever of its names is stored
        if any(p.search(name) for p in optional) or any(p.search(name) for p in converted_targets):
            continue
        missing.append(name)
    return missing, wrong


def _glob(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")


def check_checkpoint_shapes(model_dir: Path, meta: Metadata, checkpoint: Path) -> str:
    """A full-model DCP checkpoint's `model.` tensors have the shapes and floating-point kinds of the tensors of
    the same names `model_dir` stores (its safetensors headers, which `check_coverage` holds to the architecture
    of its config.json): a checkpoint of another model is refused before a rank loads it. Torch-free — `meta` is
    `dcp_metadata`'s records and no model is built, so a resuming coordinator imports no torch. A tensor stored
    there under no such name (a tied head, an MoE's experts fused as they load) is left to the ranks' load, and
    counted in the note."""
    from workers.boundary.dcp_metadata import tensors
    from workers.train_rank.checkpoint_weights import model_tensors

    stored = model_tensors(model_dir)
    first_parts = {name.partition(".")[0] for name in stored}
    checked = unmatched = 0
    for fqn, (shape, dtype) in tensors(meta).items():
        if not fqn.startswith("model."):
            continue  # the optimizer's state, a critic's weights
        name = fqn.removeprefix("model.")
        if name not in stored and name.partition(".")[0] not in first_parts:
            name = name.partition(".")[2]  # the base model's prefix, which the directory stores without
        if name not in stored:
            unmatched += 1
            continue
        stored_dtype, stored_shape = stored[name]
        if tuple(shape) != tuple(stored_shape):
            raise CheckpointError(f"{checkpoint / '.metadata'}: tensor {name} is {list(shape)}, the model of "
                                  f"{model_dir / 'config.json'} needs {list(stored_shape)} (a checkpoint of "
                                  "another model?)")
        if stored_dtype.startswith(("F", "BF")) and not dtype.floating:
            raise CheckpointError(f"{checkpoint / '.metadata'}: tensor {name} is torch.{dtype.name}, the model "
                                  "holds floating-point weights there")
        checked += 1
    rest = (f" ({unmatched} not stored under that name there, e.g. a tied head: the ranks' load checks them)"
            if unmatched else "")
    return f"{checked} tensors' shapes match the model's weights{rest}"


def check_adapter_shapes(model_dir: Path, tensors: Mapping[str, tuple[str, tuple[int, ...]]], path: Path,
                         rank: int) -> str:
    """A PEFT adapter's LoRA A and B weights fit the model's linear layers at `rank` (A: [rank, in], B: [out,
    rank]), in a floating-point dtype; its keys were matched to the target modules before."""
    from workers.train_rank.checkpoint_weights import PEFT_KEY

    key = _cache_key(model_dir, f"adapter-{rank}", [f"{n}:{d}:{list(s)}" for n, (d, s) in tensors.items()])
    if _passed_before(key):
        return "shapes fit the model (passed before)"
    if vlm_model_type(model_dir):  # an adapter's keys may name the stored tensors' modules or the loaded ones'
        return "shapes not checked (a vision-language model: the ranks check them as they load the adapter)"
    model = build_meta_model(model_dir)
    if model is None:
        return "shapes not checked (transformers does not build the model here)"
    modules = dict(model.named_modules())
    for name, (dtype, shape) in tensors.items():
        match = PEFT_KEY.match(name)
        module = modules.get(match.group(1)) if match is not None else None
        if module is None:
            raise CheckpointError(f"{path}: {name!r} adapts a module the model of {model_dir} does not have")
        sizes = getattr(module, "in_features", None), getattr(module, "out_features", None)
        if not all(isinstance(n, int) for n in sizes):
            continue  # not a linear layer: the ranks' injection says what fails
        wanted = [rank, sizes[0]] if ".lora_A" in name else [sizes[1], rank]
        if list(shape) != wanted:
            raise CheckpointError(f"{path}: {name} is {list(shape)}, a rank-{rank} adapter of that layer is {wanted}")
        if not dtype.startswith(("F", "BF")):
            raise CheckpointError(f"{path}: {name} is {dtype}, not a floating-point weight")
    _remember(key)
    return "shapes fit the model"
