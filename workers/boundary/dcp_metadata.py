"""DCP's checkpoint metadata (`.metadata`, the pickle torch.distributed.checkpoint writes) read without torch and
without running anything in it, and checked.

Owns `ALLOWED`, the one definition of which globals a `.metadata` may name (DCP's metadata dataclasses, its
memory-format enum, `torch.Size`, the torch dtypes `DTYPES` lists, the layout lookup by name, a `pathlib` path),
each mapped to a torch-free record of this module; `read_dcp_metadata(directory)`, which unpickles the file into
those records and checks them field by field (every tensor's shape and dtype, every chunk within its tensor,
every stored item in a plain-named file at a non-negative offset); and `check_shards` (every item the metadata
indexes within its shard file, every chunk stored). The coordinator's checks read a checkpoint through this
module alone (a resuming coordinator imports no torch); the ranks' `dcp.load` reads the same file into torch's
own classes through `workers.train_rank.checkpoint_files.read_metadata`, which resolves the same `ALLOWED` names
to torch's objects after this reader has checked the file.

Invariants: `find_class` returns only what `ALLOWED` maps a name to (a record class, or a function of this module
that builds a record from plain values); any other global, and any persistent id, stops the load naming it;
every failure is a `CheckpointError` naming `.metadata` and what is wrong; the file is read within
`MAX_METADATA_BYTES`.
"""

from __future__ import annotations

import io
import pickle  # noqa: TID251 - only for the subclassed, allow-listed Unpickler below (DCP writes a pickle)
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import ClassVar

from workers.boundary.manifest import CheckpointError, regular_file_size

METADATA = ".metadata"
#: DCP's metadata of the largest models is a few MiB; nothing larger is read
MAX_METADATA_BYTES = 256 << 20
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")

#: every torch dtype by the name it is pickled under (`torch.<name>`) → whether it is a floating-point type
#: (`tests/unit/test_dcp_metadata.py` holds this to the installed torch's dtypes)
DTYPES: dict[str, bool] = {
    **dict.fromkeys(("float16", "float32", "float64", "bfloat16", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz",
                     "float8_e4m3fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"), True),
    **dict.fromkeys(("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "bool", "complex32",
                     "complex64", "complex128", "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits1x8",
                     "bits2x4", "bits4x2", "bits8", "bits16", *(f"uint{n}" for n in range(1, 8)),
                     *(f"int{n}" for n in range(1, 8))), False),
}
#: the layouts `torch.serialization._get_layout` is called with (a layout pickles as that call by name)
LAYOUTS = frozenset({"torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr",
                     "torch.sparse_bsc", "torch._mkldnn", "torch.jagged"})
#: `_MEM_FORMAT_ENCODING`'s values (contiguous, channels last, preserve)
MEMORY_FORMATS = frozenset({0, 1, 2})


class _Malformed(ValueError):
    """A record given a state DCP does not write (reported as damaged metadata)."""


# ------------------------------------------------------------------------------------ the records


@dataclass(frozen=True)
class DType:
    """A torch dtype, by name."""

    name: str
    floating: bool


@dataclass(frozen=True)
class Layout:
    """A torch layout, by name (`torch.strided`)."""

    name: str


class _Record:
    """A DCP dataclass read from its pickled state (a dict of its fields): the declared fields only, each
    missing one at its class default (None)."""

    _FIELDS: ClassVar[tuple[str, ...]] = ()

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]  # (dict, slots) as protocol 2 may write it
        if not isinstance(state, dict):
            raise _Malformed(f"a {type(self).__name__} with a {type(state).__name__} for its fields")
        for name in self._FIELDS:
            if name in state:
                object.__setattr__(self, name, state[name])


class Metadata(_Record):
    _FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    state_dict_metadata: object = None
    planner_data: object = None
    storage_data: object = None
    storage_meta: object = None
    version: object = None


class TensorStorageMetadata(_Record):
    _FIELDS = ("properties", "size", "chunks")
    properties: object = None
    size: object = None
    chunks: object = None


class BytesStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    _FIELDS = ("offsets", "sizes")
    offsets: object = None
    sizes: object = None


class TensorProperties(_Record):
    """Pickled as a tuple (`TensorProperties.__getstate__`): dtype, layout, requires_grad, memory format, pinned."""

    dtype: object = None
    layout: object = None
    requires_grad: object = None
    memory_format: object = None
    pin_memory: object = None

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise _Malformed("TensorProperties' state is not its 5-tuple")
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


class MetadataIndex(_Record):
    """A key of `storage_data`: equal and hashed by (fqn, offset), as DCP's frozen dataclass."""

    _FIELDS = ("fqn", "offset", "index")
    fqn: object = None
    offset: object = None
    index: object = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and (self.fqn, self.offset) == (other.fqn, other.offset)

    def __hash__(self) -> int:
        return hash((self.fqn, self.offset))


class StorageMeta(_Record):
    _FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")
    checkpoint_id: object = None
    save_id: object = None
    load_id: object = None
    modules: object = None


class StorageInfo(_Record):
    """`filesystem._StorageInfo`: where an item's bytes lie."""

    _FIELDS = ("relative_path", "offset", "length", "transform_descriptors")
    relative_path: object = None
    offset: object = None
    length: object = None
    transform_descriptors: object = None


def _size(items: object) -> tuple[int, ...]:
    """`torch.Size(items)` (a size pickles as that call): a tuple of non-negative ints."""
    if not isinstance(items, (list, tuple)) or not all(type(n) is int and n >= 0 for n in items):
        raise _Malformed("a torch.Size of something other than non-negative integers")
    return tuple(items)


def _layout(name: object) -> Layout:
    if name not in LAYOUTS:
        raise _Malformed(f"an unknown layout {str(name)[:40]!r}")
    return Layout(str(name))


def _memory_format(value: object) -> int:
    if type(value) is not int or value not in MEMORY_FORMATS:
        raise _Malformed(f"an unknown memory format {str(value)[:40]!r}")
    return value


def _path(*parts: object) -> PurePosixPath:
    """A pickled `PosixPath` (`StorageMeta.checkpoint_id`: where it was written), kept as a pure path."""
    if not all(isinstance(part, str) for part in parts):
        raise _Malformed("a path of something other than strings")
    return PurePosixPath(*parts)  # type: ignore[arg-type]  # all str, checked above


_DCP = "torch.distributed.checkpoint.metadata"

#: (module, name) of every global a `.metadata` may name → what it is read as here. The one allow-list: the
#: ranks' reader resolves these same names to torch's objects (`checkpoint_files.read_metadata`).
ALLOWED: dict[tuple[str, str], Callable[..., object] | DType] = {
    (_DCP, "Metadata"): Metadata,
    (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP, "TensorProperties"): TensorProperties,
    (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP, "MetadataIndex"): MetadataIndex,
    (_DCP, "StorageMeta"): StorageMeta,
    (_DCP, "_MEM_FORMAT_ENCODING"): _memory_format,  # an Enum pickles as a call of its class with the value
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,  # a layout pickles as this lookup by name
    **{(module, name): _path for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")},
    **{("torch", name): DType(name, floating) for name, floating in DTYPES.items()},
}
#: the `ALLOWED` modules whose names are paths (`pathlib._local` exists from Python 3.13)
PATH_MODULES = frozenset({"pathlib", "pathlib._local"})


def refusal(source: str, module: str, name: str) -> CheckpointError:
    return CheckpointError(f"{source}: refusing to load {module}.{name}: not part of DCP's checkpoint metadata (a "
                           "crafted or foreign file)")


class _RecordUnpickler(pickle.Unpickler):
    """Resolves only `ALLOWED` names, to this module's records; anything else stops the load before it is
    looked up."""

    def __init__(self, file: io.BytesIO, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> object:
        found = ALLOWED.get((module, name))
        if found is None:
            raise refusal(self._source, module, name)
        return found

    def persistent_load(self, pid: object) -> object:
        raise CheckpointError(f"{self._source}: refusing a persistent id (not DCP's checkpoint metadata)")


# ------------------------------------------------------------------------------------ reading and checking


def read_bounded(path: Path, limit: int = MAX_METADATA_BYTES) -> bytes:
    """The file's bytes, `CheckpointError` naming it when missing, unreadable or over `limit`."""
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


def read_dcp_metadata(directory: str | Path) -> Metadata:
    """The checkpoint's `.metadata` as records, checked (see the module doc); torch is not imported."""
    path = Path(directory) / METADATA
    return parse_dcp_metadata(read_bounded(path), path)


def parse_dcp_metadata(raw: bytes, path: Path) -> Metadata:
    """`raw` (the bytes of `path`) unpickled into records and checked."""
    try:
        value = _RecordUnpickler(io.BytesIO(raw), str(path)).load()
    except CheckpointError:
        raise
    except Exception as error:  # a damaged pickle raises many types (EOFError, UnpicklingError, TypeError...)
        raise CheckpointError(f"{path}: not DCP checkpoint metadata ({type(error).__name__}: {error})") from None
    return check_metadata(value, path)


def check_metadata(value: object, path: Path) -> Metadata:
    """`value` is a well-formed `Metadata` of records (`CheckpointError` naming `path` otherwise)."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: not DCP checkpoint metadata ({what})")

    def size(item: object) -> bool:
        return isinstance(item, tuple) and all(type(n) is int and n >= 0 for n in item)

    if not isinstance(value, Metadata) or not isinstance(value.state_dict_metadata, dict):
        raise bad(f"a {type(value).__name__}, not a Metadata")
    for key, entry in value.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(f"key {key!r} is not a string")
        if isinstance(entry, TensorStorageMetadata):
            props, shape = entry.properties, entry.size
            if (not isinstance(props, TensorProperties) or not isinstance(props.dtype, DType)
                    or not isinstance(props.layout, Layout) or type(props.memory_format) is not int
                    or not size(shape) or not isinstance(entry.chunks, list)):
                raise bad(f"tensor {key} is malformed")
            for chunk in entry.chunks:
                if (not isinstance(chunk, ChunkStorageMetadata) or not size(chunk.offsets)
                        or not size(chunk.sizes) or len(chunk.offsets) != len(shape)
                        or len(chunk.sizes) != len(shape)
                        or any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, shape, strict=True))):
                    raise bad(f"a chunk of tensor {key} is malformed or outside its shape {list(shape)}")
        elif not isinstance(entry, BytesStorageMetadata):
            raise bad(f"entry {key} is a {type(entry).__name__}")
    if not isinstance(value.storage_data, dict):
        raise bad("no storage index")
    for index, info in value.storage_data.items():
        if (not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str)
                or not (index.offset is None or size(index.offset))):
            raise bad("a storage key is not a MetadataIndex")
        if (not isinstance(info, StorageInfo) or not isinstance(info.relative_path, str)
                or not _PLAIN_NAME.fullmatch(info.relative_path) or type(info.offset) is not int
                or type(info.length) is not int or info.offset < 0 or info.length < 0):
            raise bad(f"the storage of {index.fqn} is malformed")
        descriptors = info.transform_descriptors
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(isinstance(d, str) for d in descriptors)):
            raise bad(f"the transforms of {index.fqn} are malformed")
    return value


def check_shards(directory: Path, meta: Metadata) -> None:
    """Every item `meta` (checked) indexes lies within a shard file of `directory` (present, a regular file
    inside the directory, long enough), and every tensor chunk and value has its item."""
    assert isinstance(meta.storage_data, dict) and isinstance(meta.state_dict_metadata, dict)  # check_metadata's
    sizes: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        name, offset, length = str(info.relative_path), int(info.offset), int(info.length)
        if name not in sizes:
            sizes[name] = regular_file_size(directory, name, f"named by {directory / METADATA}")
        if offset + length > sizes[name]:
            raise CheckpointError(f"{directory / name}: truncated: {sizes[name]} bytes, but {index.fqn} is "
                                  f"stored at bytes {offset}..{offset + length}")
    stored = {(index.fqn, index.offset) for index in meta.storage_data}
    for key, entry in meta.state_dict_metadata.items():
        wanted = ([(key, chunk.offsets) for chunk in entry.chunks]
                  if isinstance(entry, TensorStorageMetadata) else [(key, None)])
        for item in wanted:
            if item not in stored:
                raise CheckpointError(f"{directory / METADATA}: {key} has no stored data (a shard is missing "
                                      "from the index)")


def shard_names(meta: Metadata) -> set[str]:
    """The files `meta` (checked) stores its items in."""
    assert isinstance(meta.storage_data, dict)
    return {str(info.relative_path) for info in meta.storage_data.values()}


def tensors(meta: Metadata) -> dict[str, tuple[tuple[int, ...], DType]]:
    """name → (shape, dtype) of every tensor `meta` (checked) holds."""
    assert isinstance(meta.state_dict_metadata, dict)
    return {key: (entry.size, entry.properties.dtype) for key, entry in meta.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)}
