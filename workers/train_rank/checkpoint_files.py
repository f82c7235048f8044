"""A rayless checkpoint's files read without running anything in them, and checked before anything loads.

Owns: DCP's `.metadata` in torch's own classes for `dcp.load` (`read_metadata`: checked first by the torch-free
reader `workers.boundary.dcp_metadata`, then unpickled through the same allow-list, `dcp_metadata.ALLOWED`,
resolved to torch's objects); the reader and planner `dcp.load` is given (`SafeReader`, `SafePlanner`: DCP's own
would `pickle.load` the metadata and `torch.load(weights_only=False)` every non-tensor value); the JSON files
(`extra.json`, `scheduler.json`, `rng_rank<r>.json`, `latest`) through the boundary layer's bounded decode and a
typed conversion; the manifest a save writes last (`manifest.json`: every file's size and xxh3-128 digest);
`verify_checkpoint`, which the coordinator runs before any rank starts and the ranks before they load — torch-free:
the metadata is read as `dcp_metadata`'s records.

Invariants: nothing read here can run code — both unpicklers resolve only the names `dcp_metadata.ALLOWED` lists
(the dataclasses DCP's `Metadata` is made of, `torch.Size`, torch dtypes and layouts, `pathlib` paths and the
memory-format enum), and the content is type-checked field by field; every failure is a `CheckpointError`
naming the file and what is wrong; no file is read past a bound (metadata 256 MiB, JSON by `JsonLimits`), and a
digest streams in 8 MiB blocks; importing this module, and `verify_checkpoint`, import no torch.
"""

from __future__ import annotations

import io
import pickle  # noqa: TID251 - only for the subclassed, allow-listed Unpickler below (DCP writes a pickle)
import re
from pathlib import Path
from typing import Any

import msgspec

from workers.boundary import dcp_metadata
from workers.boundary.dcp_metadata import METADATA
from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import JsonLimits, decode_json
from workers.boundary.manifest import (  # re-exported: the checkpoint's readers import them from here
    MANIFEST,
    CheckpointError,
    FileEntry,
    check_manifest,
    digest_file,
    write_json_durably,
    write_manifest,
)

#: extra.json and scheduler.json are small; an RNG state is ~5k numbers (~20 KiB), CUDA's beside it
JSON_LIMITS = JsonLimits(max_bytes=16 << 20, max_depth=32, max_items=1_000_000)


# ------------------------------------------------------------------------------------ DCP metadata, no code


def _torch_global(module: str, name: str) -> object:
    """torch's own object for an `ALLOWED` name (the same allow-list the torch-free reader maps to records)."""
    import importlib

    import torch

    if module in dcp_metadata.PATH_MODULES:
        return Path
    value = getattr(importlib.import_module(module), name)
    if module == "torch" and name in dcp_metadata.DTYPES and not isinstance(value, torch.dtype):
        raise CheckpointError(f"torch.{name} is not a dtype in this torch")
    return value


class _TorchUnpickler(pickle.Unpickler):
    """Resolves only `dcp_metadata.ALLOWED` names, to torch's own classes; anything else stops the load."""

    def __init__(self, file: io.BytesIO, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in dcp_metadata.ALLOWED:
            raise dcp_metadata.refusal(self._source, module, name)
        return _torch_global(module, name)

    def persistent_load(self, pid: object) -> Any:
        raise CheckpointError(f"{self._source}: refusing a persistent id (not DCP's checkpoint metadata)")


def read_metadata(directory: str | Path) -> Any:
    """DCP's `Metadata` of the checkpoint in `directory`, in torch's own classes (what `dcp.load` needs): the
    file is first read and checked by the torch-free reader (`dcp_metadata`: `CheckpointError` naming
    `.metadata`), then unpickled again through the same allow-list resolved to torch's objects."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / METADATA
    raw = dcp_metadata.read_bounded(path)
    dcp_metadata.parse_dcp_metadata(raw, path)
    try:
        value = _TorchUnpickler(io.BytesIO(raw), str(path)).load()
    except CheckpointError:
        raise
    except Exception as error:  # what the records accepted, torch's classes refused (a torch that changed them)
        raise CheckpointError(f"{path}: not DCP checkpoint metadata ({type(error).__name__}: {error})") from None
    if not isinstance(value, Metadata):
        raise CheckpointError(f"{path}: not DCP checkpoint metadata (a {type(value).__name__})")
    return value


def safe_reader(directory: str | Path) -> Any:
    """A DCP storage reader of `directory` whose metadata is read by `read_metadata` (never `pickle.load`)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise CheckpointError(f"{directory}: per-rank metadata files are not rayless checkpoints")
            meta = read_metadata(directory)
            if meta.storage_meta is None:
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return SafeReader(str(directory))


def safe_planner() -> Any:
    """DCP's default load planner, except that non-tensor values (the optimizer's hyper-parameters) are read
    with `torch.load(weights_only=True)`: plain values and tensors only, no code."""
    import torch
    from torch.distributed.checkpoint._nested_dict import set_element  # DCP's own, as its planner uses it
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, weights_only=True)
            except Exception as error:  # torch's weights-only unpickler refuses with UnpicklingError and others
                raise CheckpointError(f"checkpoint value {read_item.dest_index.fqn}: refused "
                                      f"({type(error).__name__}: {str(error)[:200]})") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafePlanner()


# ------------------------------------------------------------------------------------------- JSON files


class Extra(msgspec.Struct, forbid_unknown_fields=False):
    """`extra.json`: the rollout id, what the coordinator passed, and the LoRA adapters' record."""

    rollout_id: int
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    lora: dict[str, Any] | None = None


class RngState(msgspec.Struct):
    """`rng_rank<r>.json`: torch's CPU generator state (bytes) and CUDA's when there was one."""

    torch: list[int]
    cuda: list[int] | None = None


def read_json(path: Path, kind: type[Any]) -> Any:
    """`path` decoded within `JSON_LIMITS` and converted to `kind` (a Struct, dict or str)."""
    raw = dcp_metadata.read_bounded(path, JSON_LIMITS.max_bytes)
    try:
        value = decode_json(raw, str(path), JSON_LIMITS)
        converted = msgspec.convert(value, kind)
    except BoundaryError as error:
        raise CheckpointError(str(error)) from None
    except msgspec.ValidationError as error:
        raise CheckpointError(f"{path}: {error}") from None
    if isinstance(converted, RngState) and any(not 0 <= b < 256 for b in converted.torch + (converted.cuda or [])):
        raise CheckpointError(f"{path}: an RNG state holds values outside 0..255")
    return converted


# ------------------------------------------------------------------------------------------- the whole


def verify_checkpoint(directory: str | Path, *, digests: bool = True) -> Extra:
    """The whole checkpoint in `directory` checked before anything loads it: the manifest (sizes, and
    digests unless `digests` is False), DCP's metadata against its shards, every JSON file typed. Returns
    `extra.json`'s content."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    listed = check_manifest(directory, digests=digests)
    for required in (METADATA, "extra.json", "scheduler.json", "rng_rank0.json"):  # every save writes these
        if required not in listed:
            raise CheckpointError(f"{directory / required}: missing ({directory / MANIFEST} does not list it)")
    meta = dcp_metadata.read_dcp_metadata(directory)
    dcp_metadata.check_shards(directory, meta)
    unlisted = sorted(dcp_metadata.shard_names(meta) - set(listed))
    if unlisted:
        raise CheckpointError(f"{directory / METADATA}: names {unlisted[0]}, which {MANIFEST} does not list")
    extra = read_json(directory / "extra.json", Extra)
    read_json(directory / "scheduler.json", dict[str, Any])
    for name in listed:
        if re.fullmatch(r"rng_rank\d+\.json", name):
            read_json(directory / name, RngState)
    return extra


__all__ = ["MANIFEST", "CheckpointError", "FileEntry", "check_manifest", "digest_file", "write_json_durably",
           "write_manifest"]
