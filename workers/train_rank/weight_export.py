"""Hands the trained weights to engines through disk: an HF safetensors snapshot they load.

The snapshot holds the full (unsharded) Hugging Face state dict minus tied aliases (lm_head.weight when
embeddings are tied), the same tensors under the same names as a distributed update (`weight_buckets`).

Invariants: a snapshot directory `weights-<version>` appears only complete (written under a tmp name,
then renamed); old snapshots are pruned to the newest `keep`; only rank 0 writes, but every rank calls
`full_state_dict` because gathering FSDP shards is collective.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from workers.train_rank import lora
from workers.train_rank.model import tied_parameter_names

SNAPSHOT_PREFIX = "weights-"
WEIGHT_FILE_PATTERNS = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


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
        write_safetensors(state, tmp / "model.safetensors", metadata={"format": "pt"})
        for item in Path(source_dir).iterdir():
            # Config, generation config and tokenizer files make the snapshot loadable on its own.
            if item.is_file() and not item.name.endswith(WEIGHT_FILE_PATTERNS):
                shutil.copy2(item, tmp / item.name)
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


def write_safetensors(state: dict[str, torch.Tensor], path: Path, *, metadata: dict[str, str]) -> None:
    """Write `state` as one safetensors file (contiguous CPU copies; the library checks dtypes)."""
    from safetensors.torch import save_file

    save_file({name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}, str(path),
              metadata=metadata)


def prune_snapshots(directory: Path, *, keep: int, protect: Path) -> None:
    snapshots = sorted(
        (path for path in directory.iterdir() if path.is_dir() and path.name.startswith(SNAPSHOT_PREFIX)),
        key=lambda path: path.stat().st_mtime_ns,
    )
    excess = len(snapshots) - max(keep, 1)
    for path in snapshots[: max(excess, 0)]:
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)
