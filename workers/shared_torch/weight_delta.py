"""slime's delta weight updates (`--update-weight-mode delta`): the changed tensors of one sync, written by rank 0
against its CPU copy of the previous sync's weights, and applied by an engine to the weights it serves.

A delta directory (`delta-<version>/`) holds `delta.safetensors` (per changed tensor, its bytes encoded as
slime's `--update-weight-delta-encoding` says: `xor` stores `new ^ old` byte for byte, `overwrite` stores the
changed byte positions, int32 where they fit, and their new bytes), `delta.json` (encoding, checksum kind, the base version the delta
applies to, and per changed tensor its dtype, shape and the xxh3-128 of its new bytes) and the directory's
`manifest.json` (every file's size and digest, as weight snapshots have). Byte-level and dtype-blind, as slime's.

Deviations from slime (named in docs/weight-sync.md): no zstd compression (zstandard is not a dependency of
rayless), xxh3-128 the only checksum (blake3 is not one either; adler32 is weaker), and the engine applies the
delta to the weights it holds in memory rather than to a host-local checkpoint.

Invariants: `apply_delta` computes and checks every changed tensor (base version, names, dtypes, shapes, each
result's checksum) before it returns anything, so a refused delta changes no weight; a tensor is written only
when one of its bytes changed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

DELTA_PREFIX = "delta-"
DELTA_FILE = "delta.safetensors"
INDEX_FILE = "delta.json"
FORMAT = 1
ENCODINGS = ("xor", "overwrite")  # slime's --update-weight-delta-encoding choices, xor its default
CHECKSUM = "xxh3-128"  # slime's --update-weight-delta-checksum default, the one rayless computes
#: load_format of /update_weights_from_disk that applies a delta directory (rayless' engine only)
LOAD_FORMAT = "rayless_delta"
_POSITIONS, _VALUES = "::positions", "::values"


class DeltaError(ValueError):
    """A delta that cannot be applied (the message says why); nothing was changed."""


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor (a view where it already is one)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8)


def digest(raw: torch.Tensor) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(raw.numpy())


def changed_names(new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor]) -> list[str]:
    """The tensors of `new` whose bytes differ from `old`'s (a tensor `old` lacks, or of another dtype or shape,
    is changed: a delta cannot carry it, so `write_delta` refuses such a pair)."""
    changed = []
    for name, tensor in new.items():
        before = old.get(name)
        if before is None or before.dtype != tensor.dtype or before.shape != tensor.shape \
                or not torch.equal(tensor_bytes(tensor), tensor_bytes(before)):
            changed.append(name)
    return changed


def encode(new: torch.Tensor, old: torch.Tensor, encoding: str) -> dict[str, torch.Tensor]:
    raw_new, raw_old = tensor_bytes(new), tensor_bytes(old)
    if encoding == "xor":
        return {"": torch.bitwise_xor(raw_new, raw_old)}
    positions = torch.nonzero(raw_new != raw_old).reshape(-1)
    index_dtype = torch.int32 if raw_new.numel() < 2**31 else torch.int64  # half the bytes where they suffice
    return {_POSITIONS: positions.to(index_dtype), _VALUES: raw_new[positions].clone()}


def write_delta(
    new: Mapping[str, torch.Tensor],
    old: Mapping[str, torch.Tensor],
    *,
    directory: str | Path,
    weight_version: str,
    base_version: str,
    encoding: str,
) -> tuple[Path, list[str]]:
    """Rank 0: `<directory>/delta-<version>` with the tensors of `new` whose bytes differ from `old`; returns its
    path and the changed names. Appears only complete (written under a tmp name, then renamed)."""
    from safetensors.torch import save_file

    from workers.boundary.manifest import write_json_durably, write_manifest

    if encoding not in ENCODINGS:
        raise DeltaError(f"--update-weight-delta-encoding {encoding!r}: choose {', '.join(ENCODINGS)}")
    if set(new) != set(old):
        raise DeltaError(f"the weights' names changed since the base version {base_version!r}: a delta cannot "
                         "carry that; a full update must")
    mismatched = [n for n in new if new[n].dtype != old[n].dtype or new[n].shape != old[n].shape]
    if mismatched:
        raise DeltaError(f"dtype or shape changed since {base_version!r}: {', '.join(mismatched[:8])}")
    changed = changed_names(new, old)
    payload: dict[str, torch.Tensor] = {}
    tensors: dict[str, Any] = {}
    for name in changed:
        for suffix, part in encode(new[name], old[name], encoding).items():
            payload[name + suffix] = part
        tensors[name] = {"dtype": str(new[name].dtype).removeprefix("torch."), "shape": list(new[name].shape),
                         "digest": digest(tensor_bytes(new[name]))}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{DELTA_PREFIX}{safe_version(weight_version)}"
    tmp = directory / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(payload, str(tmp / DELTA_FILE), metadata={"format": "pt"})
        write_json_durably(tmp / INDEX_FILE, {
            "format": FORMAT, "encoding": encoding, "checksum": CHECKSUM, "base_version": str(base_version),
            "weight_version": str(weight_version), "total_tensors": len(new), "tensors": tensors,
        })
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, changed


def safe_version(weight_version: str) -> str:
    import re

    safe = re.sub(r"[^A-Za-z0-9._-]", "_", str(weight_version))
    if not safe or safe in (".", ".."):
        raise DeltaError(f"weight_version {weight_version!r} cannot name a directory")
    return safe


def read_index(path: Path) -> dict[str, Any]:
    """`delta.json` of a delta directory, checked against its manifest first (a damaged file is refused)."""
    from workers.boundary.errors import BoundaryError
    from workers.boundary.json_input import decode_json
    from workers.boundary.manifest import MANIFEST, CheckpointError, check_manifest

    if not (path / INDEX_FILE).is_file() or not (path / MANIFEST).is_file():
        raise DeltaError(f"{path}: not a delta directory (needs {INDEX_FILE} and {MANIFEST})")
    try:
        check_manifest(path)
        index = decode_json((path / INDEX_FILE).read_bytes(), str(path / INDEX_FILE))
    except (CheckpointError, BoundaryError) as error:
        raise DeltaError(f"refusing the delta: {error}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("encoding") not in ENCODINGS \
            or index.get("checksum") != CHECKSUM or not isinstance(index.get("tensors"), dict):
        raise DeltaError(f"{path / INDEX_FILE}: not a rayless delta index of format {FORMAT} "
                         f"(encoding one of {', '.join(ENCODINGS)}, checksum {CHECKSUM})")
    return index


def apply_delta(path: str | Path, current: Mapping[str, torch.Tensor], *, current_version: str) -> dict[str, torch.Tensor]:
    """The new tensors (on the CPU) the delta at `path` makes of `current`, the weights held at `current_version`.
    Every result is checked against its checksum before any is returned; raises DeltaError otherwise."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    index = read_index(path)
    if str(index.get("base_version")) != str(current_version):
        raise DeltaError(f"refusing the delta to {index.get('weight_version')!r}: it applies to weight version "
                         f"{index.get('base_version')!r}, this engine holds {current_version!r}")
    encoding = index["encoding"]
    results: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path / DELTA_FILE), framework="pt", device="cpu") as handle:
            stored = set(handle.keys())
            for name, entry in index["tensors"].items():
                target = current.get(name)
                if target is None:
                    raise DeltaError(f"refusing the delta: unknown parameter {name!r}")
                dtype = str(target.dtype).removeprefix("torch.")
                if entry.get("dtype") != dtype or list(entry.get("shape", ())) != list(target.shape):
                    raise DeltaError(f"refusing the delta: {name} is {entry.get('dtype')} {entry.get('shape')}, "
                                     f"the model's is {dtype} {list(target.shape)}")
                raw = tensor_bytes(target).clone()
                if encoding == "xor":
                    if name not in stored:
                        raise DeltaError(f"refusing the delta: {DELTA_FILE} lacks {name}")
                    xor = handle.get_tensor(name)
                    if xor.dtype != torch.uint8 or xor.numel() != raw.numel():
                        raise DeltaError(f"refusing the delta: {name}'s xor bytes do not match its size")
                    raw = torch.bitwise_xor(raw, xor)
                else:
                    if name + _POSITIONS not in stored or name + _VALUES not in stored:
                        raise DeltaError(f"refusing the delta: {DELTA_FILE} lacks {name}'s positions or values")
                    positions, values = handle.get_tensor(name + _POSITIONS), handle.get_tensor(name + _VALUES)
                    if positions.dtype not in (torch.int32, torch.int64) or values.dtype != torch.uint8 \
                            or positions.numel() != values.numel() \
                            or (positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < raw.numel()):
                        raise DeltaError(f"refusing the delta: {name}'s positions or values are malformed")
                    raw[positions.to(torch.int64)] = values
                if digest(raw) != entry.get("digest"):
                    raise DeltaError(f"refusing the delta: {name}'s checksum ({CHECKSUM}) does not match after "
                                     "applying it: a damaged delta or another base")
                results[name] = raw.view(target.dtype).reshape(target.shape)
    except (SafetensorError, OSError) as error:
        raise DeltaError(f"cannot read {path / DELTA_FILE}: {error}") from None
    return results


def prune_deltas(directory: Path, *, keep: int, protect: Path) -> None:
    """All but the newest `keep` delta directories are deleted (an engine reads each once)."""
    deltas = sorted((p for p in directory.iterdir() if p.is_dir() and p.name.startswith(DELTA_PREFIX)),
                    key=lambda p: p.stat().st_mtime_ns)
    for path in deltas[: max(len(deltas) - max(keep, 1), 0)]:
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)
