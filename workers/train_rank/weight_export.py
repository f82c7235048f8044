"""The trained weights as Hugging Face model directories: the engines' disk snapshots, `--save-hf`, `rayless export`.

A directory holds the full (unsharded) Hugging Face state dict minus tied aliases (lm_head.weight when
embeddings are tied), the same tensors under the same names as a distributed update (`weight_buckets`), plus
the config and tokenizer files of the model the run started from: `transformers` and SGLang load it as it is.
Engine snapshots are one `model.safetensors`; `--save-hf` and `rayless export` shard past `MAX_SHARD_BYTES`
(`model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`, Hugging Face's names).

Every directory written here carries `manifest.json` (every file's size and xxh3-128 digest), written last: an
engine checks a snapshot's before it loads it, and `rayless train` a `--save-hf` / export directory's when it is
given as `--hf-checkpoint` or `--ref-load`.

Invariants: a directory written here appears only complete (written under a tmp name, then renamed); old
snapshots are pruned to the newest `keep`; `--save-hf` replaces only an empty or Hugging Face model directory;
only rank 0 writes, but every rank calls `full_state_dict` because gathering FSDP shards is collective.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers.train_rank import lora
from workers.train_rank.model import tied_parameter_names
from workers.train_rank.tensor_files import write_safetensors

SNAPSHOT_PREFIX = "weights-"
WEIGHT_FILE_PATTERNS = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
#: the largest safetensors file of a `--save-hf` / `rayless export` directory before it is sharded
MAX_SHARD_BYTES = 5 * 1000**3
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HfDirectoryError(ValueError):
    """A Hugging Face directory that cannot be written where asked (the message names the path)."""


def full_state_dict(model: Any, *, sharded: bool) -> dict[str, torch.Tensor]:
    """Collective under FSDP. The full tensors (on CPU) every engine needs, tied aliases dropped; with LoRA
    adapters, each adapted weight merged (the engine serves a plain model)."""
    if lora.has_adapters(model):
        return {name: (entry.full_tensor() if hasattr(entry, "full_tensor") else entry).to("cpu").contiguous()
                for name, entry in lora.engine_tensors(model)}
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    tied = tied_parameter_names(model)
    return {name: tensor.to("cpu").contiguous() for name, tensor in state.items() if name not in tied}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def manifest(state: dict[str, torch.Tensor]) -> list[list[Any]]:
    return [[name, dtype_name(tensor.dtype), list(tensor.shape)] for name, tensor in state.items()]


def _safe_version(weight_version: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", str(weight_version))
    if not safe or safe in (".", ".."):
        raise ValueError(f"weight_version {weight_version!r} cannot name a directory")
    return safe


def write_snapshot(
    state: dict[str, torch.Tensor],
    *,
    source_dir: str | Path,
    directory: str | Path,
    weight_version: str,
    keep: int,
) -> Path:
    """Rank 0 only. Writes `<directory>/weights-<version>` (safetensors + the source's config and tokenizer, and
    `manifest.json` last: the sizes and digests an engine checks before it loads the snapshot)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{SNAPSHOT_PREFIX}{_safe_version(weight_version)}"
    tmp = directory / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_safetensors(state, tmp / SINGLE_FILE, metadata={"format": "pt"})
        copy_model_files(source_dir, tmp)
        (tmp / "rayless_weight_version.txt").write_text(str(weight_version) + "\n")
        from workers.train_rank.checkpoint_files import write_manifest

        write_manifest(tmp)  # last: every file's size and digest, checked by the engine that loads it
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_snapshots(directory, keep=keep, protect=final)
    return final


def copy_model_files(source_dir: str | Path, directory: Path) -> None:
    """The source model's config, generation config and tokenizer files (every file but weights, their index
    and the source's own manifest, which lists other weights): what makes a directory of weights loadable on
    its own."""
    from workers.boundary.manifest import MANIFEST

    for item in Path(source_dir).iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_FILE_PATTERNS) and item.name != MANIFEST:
            shutil.copy2(item, directory / item.name)


def shard_plan(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """The tensors' names per file, in state-dict order: a file is closed before it would pass
    `max_shard_bytes` (a tensor larger than that is a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(state: dict[str, torch.Tensor], directory: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """`model.safetensors`, or past `max_shard_bytes` the shards and their index, as `save_pretrained` names them."""
    shards = shard_plan(state, max_shard_bytes)
    if len(shards) == 1:
        write_safetensors(state, directory / SINGLE_FILE, metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for number, names in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors({name: state[name] for name in names}, directory / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, filename))
    total = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_hf_directory(
    state: dict[str, torch.Tensor],
    *,
    source_dir: str | Path,
    directory: str | Path,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Rank 0 (or `rayless export`): `directory` as a Hugging Face model directory of `state` with the source's
    config and tokenizer files; `write_extra(tmp)` adds files before it appears (a LoRA adapter). One already
    there is replaced, but only when it is empty or a Hugging Face model directory (config.json): a save never
    deletes anything else. Appears only complete: written beside it under a tmp name, then swapped in."""
    final = Path(directory).absolute()
    if final.exists() and not _replaceable(final):
        raise HfDirectoryError(f"{final}: exists and is not a Hugging Face model directory (no config.json) nor "
                               "empty; name a new directory or an earlier export to replace")
    if final.exists() and Path(source_dir).absolute().resolve() == final.resolve():
        raise HfDirectoryError(f"{final}: the model the run started from; name another directory")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_weights(state, tmp, max_shard_bytes=max_shard_bytes)
        copy_model_files(source_dir, tmp)
        if write_extra is not None:
            write_extra(tmp)
        from workers.train_rank.checkpoint_files import write_manifest

        write_manifest(tmp)  # last: every file's size and digest, checked when the directory is loaded again
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            os.rename(old, final)  # put the earlier directory back
        raise
    shutil.rmtree(old, ignore_errors=True)
    return final


def _replaceable(path: Path) -> bool:
    return path.is_dir() and ((path / "config.json").is_file() or not any(path.iterdir()))


def prune_snapshots(directory: Path, *, keep: int, protect: Path) -> None:
    snapshots = sorted(
        (path for path in directory.iterdir() if path.is_dir() and path.name.startswith(SNAPSHOT_PREFIX)),
        key=lambda path: path.stat().st_mtime_ns,
    )
    excess = len(snapshots) - max(keep, 1)
    for path in snapshots[: max(excess, 0)]:
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)
