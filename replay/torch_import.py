"""Import of slime / miles `.pt` rollout dumps into rayless `Sample`s, without ever executing their content.

Owns the one place rayless reads a pickle-based file, and the conversion of slime's fields (listed in
docs/replay.md). Invariant: nothing in the file can run code — a `torch.save` zip goes through
`torch.load(weights_only=True)`, a bare pickle through `_PlainUnpickler` (no global but
`set`/`frozenset`/`OrderedDict`, no persistent id); anything else is a `DumpError` before its callable is looked
up. And converting costs memory in proportion to the file's size: a zip declaring more than `MAX_EXPANSION`
times its size is refused before decompression, and the loaded data is measured (`bounds.measure_plain`)
before it is converted.
"""

from __future__ import annotations

import io
import json
import os
import pickle  # noqa: TID251 - only for the subclassed Unpickler below, which resolves no code at all
import warnings
import zipfile
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any

from replay import bounds
from replay.format import DumpError, write_dump
from replay.sample import Sample, SampleError, SampleStatus

_KNOWN_KEYS = {
    "index",
    "group_index",
    "sample_index",
    "prompt",
    "tokens",
    "response",
    "response_length",
    "label",
    "reward",
    "loss_mask",
    "rollout_log_probs",
    "status",
    "metadata",
    "weight_versions",
    "advantage",
}
_STATUS_ALIASES = {s.value: s for s in SampleStatus} | {"failed": SampleStatus.ABORTED}
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


def _load(path: Path, size: int) -> Any:
    refusal = (
        "refused to load {path}: it holds something other than plain containers, numbers, strings and "
        "tensors ({detail}); it was not executed. If you trust the file, re-save its samples as plain dicts."
    )
    if zipfile.is_zipfile(path):
        _check_zip(path, size)
        # Fast path: slime's Sample.to_dict() dumps hold lists, not tensors, so the pickle inside the zip
        # usually needs no torch global at all; our C-speed plain unpickler reads it ~10x faster than
        # torch's pure-Python weights-only unpickler. Tensors send us to torch's loader.
        try:
            return _load_zip_plain(path)
        except _Refused as exc:
            raise DumpError(refusal.format(path=path, detail=exc)) from None
        except (_NeedsTorch, KeyError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError):
            pass
        import torch

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise DumpError(refusal.format(path=path, detail=_torch_detail(exc))) from None
        except (RuntimeError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise DumpError(f"{path}: not a readable torch.save file: {exc}") from None
    data = path.read_bytes()
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise DumpError(refusal.format(path=path, detail=exc)) from None
    except _NeedsTorch as exc:
        detail = f"torch global {exc} in a bare pickle; only torch.save files may hold tensors"
        raise DumpError(refusal.format(path=path, detail=detail)) from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        AttributeError,
        MemoryError,
    ) as exc:
        raise DumpError(f"{path}: neither a torch.save file nor a readable pickle ({exc!r:.120})") from None


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


def _plain(value: Any, where: str) -> Any:
    """Tensors → lists/scalars, recursively; raises SampleError on anything that is not plain data."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, dict):
        return {k: _plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, where) for v in value)
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v, where) for v in value), key=repr)
    if hasattr(value, "tolist") and type(value).__module__.startswith("torch"):
        return value.tolist()
    raise SampleError(f"{where}: cannot convert a {type(value).__name__}")


def _numbers(value: Any, typecode: str, where: str, name: str) -> list[Any]:
    """A list/tensor of numbers as Python ints ('q') or floats ('d'), converted in C, not per element."""
    if not isinstance(value, list):
        value = _as_list(value, where, name)
    try:
        return array(typecode, value).tolist()
    except (TypeError, OverflowError):
        kind = "64-bit integers" if typecode == "q" else "numbers"
        raise SampleError(f"{where}: {name} must hold {kind}, got {value[:4]!r:.80}...") from None


def _as_list(value: Any, where: str, name: str) -> list[Any]:
    value = _plain(value, where)
    if not isinstance(value, list):
        raise SampleError(f"{where}: {name} must be a list or a 1-d tensor, got {type(value).__name__}")
    return value


def _reward(value: Any, where: str) -> float | dict[str, float] | None:
    value = _plain(value, where)
    if value is None or isinstance(value, dict):
        if isinstance(value, dict):
            try:
                return {str(k): float(v) for k, v in value.items()}
            except (TypeError, ValueError):
                raise SampleError(f"{where}: reward dict {value!r:.80} has non-numeric values") from None
        return value
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, list) and len(value) == 1:
        return float(value[0])
    raise SampleError(f"{where}: reward {value!r:.80} is neither a number, a dict nor None")


def convert_sample(
    raw: Any,
    position: int,
    *,
    n_samples_per_prompt: int | None = None,
    allow_missing_logprobs: bool = False,
) -> Sample:
    """One slime/miles sample dict → a validated rayless Sample (SampleError says what is missing)."""
    where = f"sample #{position}"
    if not isinstance(raw, dict):
        raise SampleError(f"{where}: expected a dict, got {type(raw).__name__}")
    tokens = _numbers(raw.get("tokens"), "q", where, "tokens") if "tokens" in raw else None
    if tokens is None:
        raise SampleError(f"{where}: has no 'tokens'")
    response_length = _plain(raw.get("response_length"), where)
    if not isinstance(response_length, int):
        raise SampleError(f"{where}: 'response_length' must be an int, got {response_length!r:.40}")

    metadata: dict[str, Any] = {}
    loss_mask_raw = raw.get("loss_mask")
    loss_mask = (
        [1] * response_length if loss_mask_raw is None else _numbers(loss_mask_raw, "q", where, "loss_mask")
    )
    logprobs_raw = raw.get("rollout_log_probs")
    if logprobs_raw is None:
        if not allow_missing_logprobs:
            raise SampleError(
                f"{where}: has no rollout_log_probs; the PPO ratio would be computed against invented "
                "values. Pass --allow-missing-logprobs to fill zeros (flagged in metadata) anyway."
            )
        logprobs = [0.0] * response_length
        metadata["rollout_log_probs_missing"] = True
    else:
        logprobs = _numbers(logprobs_raw, "d", where, "rollout_log_probs")

    index = _plain(raw.get("index"), where)
    group_index = _plain(raw.get("group_index"), where)
    if not isinstance(group_index, int):
        if isinstance(index, int) and n_samples_per_prompt:
            group_index = index // n_samples_per_prompt
        else:
            raise SampleError(
                f"{where}: has no group_index; pass --n-samples-per-prompt so it can be derived from 'index'"
            )
    sample_index = _plain(raw.get("sample_index"), where)
    if not isinstance(sample_index, int):
        sample_index = index if isinstance(index, int) else position

    status_raw = _plain(raw.get("status", "completed"), where)
    status_value = getattr(status_raw, "value", status_raw)
    if isinstance(status_value, str):
        status_value = status_value.lower().removeprefix("status.")
    status = _STATUS_ALIASES.get(status_value) if isinstance(status_value, str) else None
    if status is None:
        raise SampleError(f"{where}: unknown status {status_raw!r:.40}")
    if status_value == "failed":
        metadata["slime_status"] = "failed"

    prompt = _plain(raw.get("prompt", ""), where)
    if isinstance(prompt, list):
        metadata["prompt_messages"] = prompt
        prompt = "\n".join(
            f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in prompt
        )
    elif not isinstance(prompt, str):
        raise SampleError(f"{where}: prompt must be a str or a list of messages, got {type(prompt).__name__}")

    label = _plain(raw.get("label"), where)
    if label is not None and not isinstance(label, str):
        label = json.dumps(label, sort_keys=True, default=str)
        metadata["label_is_json"] = True

    response = _plain(raw.get("response", ""), where)
    if not isinstance(response, str):
        raise SampleError(f"{where}: response must be a str, got {type(response).__name__}")

    weight_versions = [str(v) for v in _as_list(raw.get("weight_versions") or [], where, "weight_versions")]
    advantage = _plain(raw.get("advantage", 0.0), where)
    advantage = float(advantage) if isinstance(advantage, (int, float)) else 0.0

    source_metadata = _plain(raw.get("metadata") or {}, where)
    if not isinstance(source_metadata, dict):
        source_metadata = {"value": source_metadata}
    metadata = {**source_metadata, **metadata}
    extra: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in raw.items():
        if key in _KNOWN_KEYS:
            continue
        try:
            extra[str(key)] = _plain(value, where)
        except SampleError:
            dropped.append(str(key))
    if isinstance(index, int):
        extra["index"] = index
    if extra:
        metadata["slime"] = extra
    if dropped:
        metadata["slime_dropped"] = dropped

    sample = Sample(
        group_index=group_index,
        sample_index=sample_index,
        prompt=prompt,
        tokens=tokens,
        response_length=response_length,
        loss_mask=loss_mask,
        rollout_log_probs=logprobs,
        reward=_reward(raw.get("reward"), where),
        status=status,
        weight_versions=weight_versions,
        label=label,
        response=response,
        advantage=advantage,
        metadata=metadata,
    )
    sample.validate()
    return sample


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
        rollout_id = _plain(data.get("rollout_id"), str(path))
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
        metadata = _plain(data.get("metadata") or {}, str(path))
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
