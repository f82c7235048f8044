"""Import of slime / miles `.pt` rollout dumps into rayless `Sample`s, without ever executing their content.

Owns the one place rayless reads a pickle-based file; one sample's fields are converted by
`replay.slime_sample` (the fields are listed in docs/replay.md). Invariant: nothing in the file can run code — a `torch.save` zip goes through
`torch.load(weights_only=True)`, a bare pickle through `_PlainUnpickler` (no global but
`set`/`frozenset`/`OrderedDict`, no persistent id); anything else is a `DumpError` before its callable is looked
up. And converting costs memory in proportion to the file's size: a zip declaring more than `MAX_EXPANSION`
times its size is refused before decompression, and the loaded data is measured (`bounds.measure_plain`)
before it is converted.
"""

from __future__ import annotations

import io
import os
import pickle  # noqa: TID251 - only for the subclassed Unpickler below, which resolves no code at all
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

from replay import bounds
from replay.format import DumpError, write_dump
from replay.sample import Sample, SampleError
from replay.slime_sample import convert_sample, plain

#: bytes of Python objects an import may build beyond `bounds.MAX_EXPANSION` times the file's size
IMPORT_ALLOWANCE = 64 * 1024 * 1024


class _Refused(pickle.UnpicklingError):
    """The file asks for a global or persistent object; raised before anything is resolved."""


class _NeedsTorch(pickle.UnpicklingError):
    """The pickle holds tensors; only torch's weights-only unpickler may rebuild them."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds only plain containers and scalars; every other global or persistent id is refused."""

    _ALLOWED = {
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("__builtin__", "set"): set,
        ("__builtin__", "frozenset"): frozenset,
        ("collections", "OrderedDict"): OrderedDict,
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = self._ALLOWED.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch" or module.startswith("torch."):
            # A tensor (or torch.Size, ...): leave it to torch's own weights-only unpickler, which knows
            # which torch globals are safe. Nothing has been resolved yet.
            raise _NeedsTorch(f"{module}.{name}")
        raise _Refused(f"refusing to load global {module}.{name} (not plain data)")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("refusing a persistent id (a legacy torch storage or custom object)")


def import_budget(file_size: int) -> int:
    """Bytes of Python objects (or of zip entries) an import of a `file_size`-byte file may reach."""
    return bounds.MAX_EXPANSION * file_size + IMPORT_ALLOWANCE


def load_plain(path: str | os.PathLike[str]) -> Any:
    """Load a slime/miles dump (torch.save zip or bare pickle) as plain data, refusing anything executable
    and anything whose plain expansion would pass `import_budget` (see the module's bounds)."""
    path = Path(path)
    if path.is_dir():
        raise DumpError(f"{path}: is a directory, not a .pt dump")
    if not path.exists():
        raise DumpError(f"{path}: no such file")
    size = path.stat().st_size
    if size == 0:
        raise DumpError(f"{path}: empty file (0 bytes)")
    data = _load(path, size)
    try:
        bounds.measure_plain(data, import_budget(size))
    except bounds.BoundError as exc:
        raise DumpError(f"refused to import {path}: {exc}") from None
    return data


def _check_zip(path: Path, size: int) -> None:
    """Refuse a zip whose entries unpack to far more than the file holds, before decompressing any."""
    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise DumpError(f"{path}: not a readable torch.save file: {exc}") from None
    if declared > import_budget(size):
        raise DumpError(
            f"refused to import {path}: its zip entries unpack to {declared} bytes from a {size}-byte file, "
            f"over the bound of {import_budget(size)} (torch.save does not compress; this is a zip bomb or "
            "a re-compressed dump: unzip and re-save it uncompressed)"
        )


_REFUSAL = (
    "refused to load {path}: it holds something other than plain containers, numbers, strings and "
    "tensors ({detail}); it was not executed. If you trust the file, re-save its samples as plain dicts."
)


def _load(path: Path, size: int) -> Any:
    if zipfile.is_zipfile(path):
        _check_zip(path, size)
        # Fast path: slime's Sample.to_dict() dumps hold lists, not tensors, so the pickle inside the zip
        # usually needs no torch global at all; our C-speed plain unpickler reads it ~10x faster than
        # torch's pure-Python weights-only unpickler. Tensors send us to torch's loader.
        try:
            return _load_zip_plain(path)
        except _Refused as exc:
            raise DumpError(_REFUSAL.format(path=path, detail=exc)) from None
        except (_NeedsTorch, KeyError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError):
            pass
        except Exception as exc:  # an allowed global (set, OrderedDict) built from bad arguments
            raise DumpError(_unreadable(path, exc)) from None
        return _torch_load(path)
    data = path.read_bytes()
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise DumpError(_REFUSAL.format(path=path, detail=exc)) from None
    except _NeedsTorch as exc:
        detail = f"torch global {exc} in a bare pickle; only torch.save files may hold tensors"
        raise DumpError(_REFUSAL.format(path=path, detail=detail)) from None
    except Exception as exc:  # any fault of untrusted bytes is the file's, never ours
        raise DumpError(f"{path}: neither a torch.save file nor a readable pickle ({exc!r:.120})") from None


def _torch_load(path: Path) -> Any:
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise DumpError(_REFUSAL.format(path=path, detail=_torch_detail(exc))) from None
    except Exception as exc:  # torch's loader on untrusted bytes: any fault is the file's
        raise DumpError(_unreadable(path, exc)) from None


def _unreadable(path: Path, exc: BaseException) -> str:
    """What the pickle asked for that cannot be built (`set([[1]])`, `OrderedDict(5)`, a missing memo)."""
    return f"{path}: not a readable torch.save file: its pickle fails to build ({type(exc).__name__}: {exc!s:.160})"


def _load_zip_plain(path: Path) -> Any:
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(names) != 1:
            raise KeyError("no single data.pkl in the archive")
        with archive.open(names[0]) as stream:
            return _PlainUnpickler(stream).load()


def _torch_detail(exc: Exception) -> str:
    # torch's message is long and tells users to set weights_only=False; keep only the unpickler's reason.
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].strip().split("\n\n")[0]
    return text.strip()[:300]


def import_torch_dump(
    path: str | os.PathLike[str],
    *,
    n_samples_per_prompt: int | None = None,
    allow_missing_logprobs: bool = False,
    rollout_id: int | None = None,
) -> tuple[int, list[Sample], dict[str, Any]]:
    """(rollout_id, samples, plain top-level metadata) from a slime/miles dump; DumpError on any fault.

    `rollout_id` overrides the id stored in the file (needed for forks that dump a bare sample list).
    """
    path = Path(path)
    data = load_plain(path)
    if isinstance(data, list):
        # Forks that dump the bare sample list carry no rollout id; the caller must give one.
        data = {"rollout_id": None, "samples": data}
    if not isinstance(data, dict) or "samples" not in data:
        raise DumpError(f"{path}: expected a dict with 'rollout_id' and 'samples', got {type(data).__name__}")
    if rollout_id is None:
        rollout_id = plain(data.get("rollout_id"), str(path))
    if isinstance(rollout_id, str) and rollout_id.isdigit():
        rollout_id = int(rollout_id)
    if not isinstance(rollout_id, int):
        raise DumpError(f"{path}: rollout_id {rollout_id!r:.40} is not an int; pass it with --rollout-id")
    raw_samples = data["samples"]
    if not isinstance(raw_samples, list):
        raise DumpError(f"{path}: 'samples' must be a list, got {type(raw_samples).__name__}")
    samples = []
    for position, raw in enumerate(raw_samples):
        try:
            samples.append(
                convert_sample(
                    raw,
                    position,
                    n_samples_per_prompt=n_samples_per_prompt,
                    allow_missing_logprobs=allow_missing_logprobs,
                )
            )
        except (SampleError, TypeError, ValueError) as exc:
            raise DumpError(f"{path}: {exc}") from None
    try:
        metadata = plain(data.get("metadata") or {}, str(path))
    except SampleError:
        metadata = {}
    return rollout_id, samples, metadata if isinstance(metadata, dict) else {"value": metadata}


def convert_torch_dump(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    n_samples_per_prompt: int | None = None,
    allow_missing_logprobs: bool = False,
    rollout_id: int | None = None,
) -> Path:
    """Convert a slime/miles `.pt` dump into a rayless dump at `dst` (written atomically)."""
    found_id, samples, metadata = import_torch_dump(
        src,
        n_samples_per_prompt=n_samples_per_prompt,
        allow_missing_logprobs=allow_missing_logprobs,
        rollout_id=rollout_id,
    )
    facts: dict[str, Any] = {"source": str(src), "source_format": "slime/miles torch.save"}
    if n_samples_per_prompt is not None:
        facts["n_samples_per_prompt"] = n_samples_per_prompt
    if metadata:
        facts["source_metadata"] = metadata
    try:
        return write_dump(dst, found_id, samples, config_facts=facts)
    except DumpError as exc:
        if "config_facts" not in str(exc):
            raise
        # Source metadata that msgpack cannot hold (e.g. bytes keys of odd types) is not worth failing for.
        facts.pop("source_metadata", None)
        return write_dump(dst, found_id, samples, config_facts=facts)
