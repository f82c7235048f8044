"""Safetensors files and the model or adapter directories that hold them, checked from their headers alone.

Owns `check_safetensors` (one file: a bounded header of known dtypes whose tensors fill the data exactly, and
a file exactly as long as the header says), `model_tensors` (every tensor a model directory stores, through its
index or its one file, each file checked) and `check_adapter_keys` (a PEFT adapter's keys name LoRA A/B
weights of the target modules). Invariant: no tensor data is read, no code is imported, nothing beyond
`MAX_HEADER_BYTES` is read from a header; every failure is a `CheckpointError` naming the file and what is
wrong (a truncated `model.safetensors` is refused here, before transformers fills what is missing with fresh
weights).
"""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path
from typing import Any

from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import JsonLimits, decode_json
from workers.train_rank.checkpoint_files import CheckpointError

#: a header larger than this is not read (the largest real ones are a few MiB)
MAX_HEADER_BYTES = 256 << 20
_HEADER_LIMITS = JsonLimits(max_bytes=MAX_HEADER_BYTES, max_depth=4, max_items=20_000_000)
#: bytes per element of every dtype safetensors writes
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
               "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}
INDEX = "model.safetensors.index.json"


def check_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name → (dtype, shape) of every tensor in `path`, after checking the header against the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file (truncated)")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise CheckpointError(f"{path}: declares a {length}-byte header in a {size}-byte file "
                                      "(truncated or not safetensors)")
            raw = handle.read(length)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
    try:
        header = decode_json(raw, str(path), _HEADER_LIMITS)
    except BoundaryError as error:
        raise CheckpointError(f"{error} (a damaged safetensors header)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            valid = (isinstance(dtype, str) and isinstance(shape, list)
                     and all(type(n) is int and n >= 0 for n in (*shape, begin, end)) and begin <= end)
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry")
        if dtype not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r}, not one rayless reads")
        if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise CheckpointError(f"{path}: tensor {name!r} ({dtype} {shape}) spans {end - begin} bytes, not "
                                  f"{math.prod(shape) * DTYPE_BYTES[dtype]}")
        tensors[name] = (dtype, tuple(shape))
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise CheckpointError(f"{path}: tensor {name!r} starts at byte {begin} of the data, expected {position} "
                                  "(overlapping or a gap)")
        position = end
    if 8 + length + position != size:
        state = "truncated" if size < 8 + length + position else "longer than its header says"
        raise CheckpointError(f"{path}: {size} bytes, the header describes {8 + length + position} ({state})")
    return tensors


def model_tensors(model_dir: Path, files_of: dict[str, Path] | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor the model directory stores (the index's files, or `model.safetensors`), each file checked;
    a tensor the index maps to a file that lacks it is an error. `files_of`, when given, gets each tensor's file."""
    index = model_dir / INDEX
    if index.is_file():
        try:
            if index.stat().st_size > 64 << 20:
                raise TypeError("over 64 MiB")
            weight_map = decode_json(index.read_bytes(), str(index), JsonLimits(max_depth=8))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError
        except (OSError, BoundaryError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index}: not a safetensors index ({error})") from None
        files = sorted(set(weight_map.values()))
    else:
        weight_map = None
        files = ["model.safetensors"] if (model_dir / "model.safetensors").is_file() else []
    if not files:
        found = [p.name for p in model_dir.glob("*.bin")] or [p.name for p in model_dir.glob("*.pt")]
        why = f" (found {', '.join(found[:3])}: pickle, refused)" if found else ""
        raise CheckpointError(f"{model_dir}: no model.safetensors or {INDEX}{why}")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in files:
        path = model_dir / name
        if Path(name).name != name or not path.is_file():
            raise CheckpointError(f"{path}: missing (named by {index})")
        stored = check_safetensors(path)
        if weight_map is not None:
            for tensor, where in weight_map.items():
                if where == name and tensor not in stored:
                    raise CheckpointError(f"{path}: lacks {tensor}, which {index.name} maps to it")
        tensors.update(stored)
        if files_of is not None:
            files_of.update(dict.fromkeys(stored, path))
    return tensors


#: a PEFT adapter key: the adapted module is group 1
PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_[AB](?:\.[A-Za-z0-9_]+)?\.weight$")


def check_adapter_keys(path: Path, tensors: dict[str, Any], target_modules: list[str]) -> None:
    """Every key of a PEFT adapter file is a LoRA A or B weight of a module named in `target_modules`, and
    every adapted module has both."""
    seen: dict[str, set[str]] = {}
    for key in tensors:
        match = PEFT_KEY.match(key)
        if match is None:
            raise CheckpointError(f"{path}: {key!r} is not a LoRA A/B weight")
        module = match.group(1)
        if target_modules and module.rsplit(".", 1)[-1] not in target_modules:
            raise CheckpointError(f"{path}: {key!r} adapts {module}, which is not one of the target modules "
                                  f"{','.join(target_modules)}")
        seen.setdefault(module, set()).add("A" if ".lora_A" in key else "B")
    if not seen:
        raise CheckpointError(f"{path}: holds no LoRA weights")
    for module, halves in seen.items():
        if halves != {"A", "B"}:
            raise CheckpointError(f"{path}: {module} has lora_{''.join(halves)} but not its other half")
