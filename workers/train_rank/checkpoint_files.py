"""A rayless checkpoint's files read without running anything in them, and checked before anything loads.

Owns: DCP's `.metadata` read through an allow-listed unpickler (`read_metadata`: the one function every reader
of a checkpoint's metadata calls — `--load`, `--ref-load`, train-FT reloads, `rayless export`); the reader and
planner `dcp.load` is given (`SafeReader`, `SafePlanner`: DCP's own would `pickle.load` the metadata and
`torch.load(weights_only=False)` every non-tensor value); the JSON files (`extra.json`, `scheduler.json`,
`rng_rank<r>.json`, `latest`) through the boundary layer's bounded decode and a typed conversion; the manifest
a save writes last (`manifest.json`: every file's size and xxh3-128 digest); `verify_checkpoint`, which the
coordinator runs before any rank starts and the ranks before they load.

Invariants: nothing read here can run code — the unpickler resolves only the dataclasses DCP's `Metadata` is
made of, `torch.Size`, torch dtypes and layouts, `pathlib` paths and the memory-format enum, and the result is
type-checked field by field; every failure is a `CheckpointError` naming the file and what is wrong; no file
is read past a bound (metadata 256 MiB, JSON by `JsonLimits`), and a digest streams in 8 MiB blocks.
"""

from __future__ import annotations

import io
import pickle  # noqa: TID251 - only for the subclassed, allow-listed Unpickler below (DCP writes a pickle)
import re
from pathlib import Path
from typing import Any

import msgspec

from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import JsonLimits, decode_json
from workers.boundary.manifest import (  # re-exported: the checkpoint's readers import them from here
    MANIFEST,
    CheckpointError,
    FileEntry,
    check_manifest,
    digest_file,
    regular_file_size,
    write_json_durably,
    write_manifest,
)

METADATA = ".metadata"
#: DCP's metadata of the largest models is a few MiB; nothing larger is read
MAX_METADATA_BYTES = 256 << 20
#: extra.json and scheduler.json are small; an RNG state is ~5k numbers (~20 KiB), CUDA's beside it
JSON_LIMITS = JsonLimits(max_bytes=16 << 20, max_depth=32, max_items=1_000_000)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


# ------------------------------------------------------------------------------------ DCP metadata, no code


def _allowed() -> dict[tuple[str, str], Any]:
    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
        for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                     "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    # a layout is pickled as a call of this lookup by name (it returns an existing torch.layout, nothing else)
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for module in ("pathlib", "pathlib._local"):  # StorageMeta.checkpoint_id: where it was written
        allowed[(module, "PosixPath")] = Path
        allowed[(module, "PurePosixPath")] = Path
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the allow-listed names; anything else stops the load before it is looked up."""

    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self._source = source
        self._names = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        found = self._names.get((module, name))
        if found is not None:
            return found
        if module == "torch" and re.fullmatch(r"[a-z0-9_]+", name):
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout)):
                return value
        raise CheckpointError(f"{self._source}: refusing to load {module}.{name}: not part of DCP's checkpoint "
                              "metadata (a crafted or foreign file)")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self._source}: refusing a persistent id (not DCP's checkpoint metadata)")


def read_metadata(directory: str | Path) -> Any:
    """DCP's `Metadata` of the checkpoint in `directory`, read without running anything in the file and
    type-checked (`CheckpointError` naming `.metadata` otherwise). The one reader of that file."""
    path = Path(directory) / METADATA
    raw = _read_bounded(path, MAX_METADATA_BYTES)
    try:
        value = _MetadataUnpickler(io.BytesIO(raw), str(path)).load()
    except CheckpointError:
        raise
    except Exception as error:  # a damaged pickle raises many types (EOFError, UnpicklingError, TypeError...)
        raise CheckpointError(f"{path}: not DCP checkpoint metadata ({type(error).__name__}: {error})") from None
    _check_metadata(value, path)
    return value


def _check_metadata(value: Any, path: Path) -> None:
    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: not DCP checkpoint metadata ({what})")

    def size(item: Any) -> bool:
        return isinstance(item, torch.Size) and all(isinstance(n, int) and n >= 0 for n in item)

    if not isinstance(value, metadata.Metadata) or not isinstance(value.state_dict_metadata, dict):
        raise bad(f"a {type(value).__name__}, not a Metadata")
    for key, entry in value.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(f"key {key!r} is not a string")
        if isinstance(entry, metadata.TensorStorageMetadata):
            props = entry.properties
            if (not isinstance(props, metadata.TensorProperties) or not isinstance(props.dtype, torch.dtype)
                    or not size(entry.size) or not isinstance(entry.chunks, list)):
                raise bad(f"tensor {key} is malformed")
            for chunk in entry.chunks:
                if (not isinstance(chunk, metadata.ChunkStorageMetadata) or not size(chunk.offsets)
                        or not size(chunk.sizes) or len(chunk.offsets) != len(entry.size)
                        or len(chunk.sizes) != len(entry.size)
                        or any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size, strict=True))):
                    raise bad(f"a chunk of tensor {key} is malformed or outside its shape {list(entry.size)}")
        elif not isinstance(entry, metadata.BytesStorageMetadata):
            raise bad(f"entry {key} is a {type(entry).__name__}")
    if not isinstance(value.storage_data, dict):
        raise bad("no storage index")
    for index, info in value.storage_data.items():
        if not isinstance(index, metadata.MetadataIndex) or not isinstance(index.fqn, str):
            raise bad("a storage key is not a MetadataIndex")
        if (not isinstance(info, filesystem._StorageInfo) or not isinstance(info.relative_path, str)
                or not _PLAIN_NAME.fullmatch(info.relative_path) or type(info.offset) is not int
                or type(info.length) is not int or info.offset < 0 or info.length < 0):
            raise bad(f"the storage of {index.fqn} is malformed")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(isinstance(d, str) for d in descriptors)):
            raise bad(f"the transforms of {index.fqn} are malformed")


def check_shards(directory: Path, meta: Any) -> None:
    """Every item the metadata indexes lies within a shard file of `directory` (present, a regular file
    inside the directory, long enough), and every tensor chunk and value has its item."""
    from torch.distributed.checkpoint import metadata

    sizes: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        name = info.relative_path
        if name not in sizes:
            sizes[name] = regular_file_size(directory, name, f"named by {directory / METADATA}")
        if info.offset + info.length > sizes[name]:
            raise CheckpointError(f"{directory / name}: truncated: {sizes[name]} bytes, but {index.fqn} is "
                                  f"stored at bytes {info.offset}..{info.offset + info.length}")
    stored = {(index.fqn, tuple(index.offset) if index.offset is not None else None) for index in meta.storage_data}
    for key, entry in meta.state_dict_metadata.items():
        wanted = ([(key, tuple(chunk.offsets)) for chunk in entry.chunks]
                  if isinstance(entry, metadata.TensorStorageMetadata) else [(key, None)])
        for item in wanted:
            if item not in stored:
                raise CheckpointError(f"{directory / METADATA}: {key} has no stored data (a shard is missing "
                                      "from the index)")


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
    raw = _read_bounded(path, JSON_LIMITS.max_bytes)
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
    meta = read_metadata(directory)
    check_shards(directory, meta)
    unlisted = sorted({info.relative_path for info in meta.storage_data.values()} - set(listed))
    if unlisted:
        raise CheckpointError(f"{directory / METADATA}: names {unlisted[0]}, which {MANIFEST} does not list")
    extra = read_json(directory / "extra.json", Extra)
    read_json(directory / "scheduler.json", dict[str, Any])
    for name in listed:
        if re.fullmatch(r"rng_rank\d+\.json", name):
            read_json(directory / name, RngState)
    return extra


def _read_bounded(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as handle:
            raw = handle.read(limit + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
    if len(raw) > limit:
        raise CheckpointError(f"{path}: larger than the {limit >> 20} MiB this file may be")
    return raw


__all__ = ["MANIFEST", "CheckpointError", "FileEntry", "check_manifest", "digest_file", "write_json_durably",
           "write_manifest"]
