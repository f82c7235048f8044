"""The rayless rollout dump format: writer, streaming reader, integrity checks, path templates.

Owns the on-disk layout of one rollout (or eval) dump — MAGIC | version | frame 'H' (header) | frames 'S' (one
per sample) | frame 'T' (trailer: count and chained CRC), each frame tag | length | CRC32 | msgpack payload —
and formats 2 (written) and 1 (read). One module over 450 lines: each rule the reader enforces is refused on
write beside it. The layout in full: docs/replay.md.

Invariants:
- A dump file either does not exist or is complete (temporary file, fsync, `os.replace`).
- Nothing read from a dump is ever executed: msgpack only, never pickle.
- Every fault of a file, checksums valid or not, is a `DumpError` naming the file, never another exception or a
  crash (each record passes `replay.bounds` before msgpack builds anything).
- Every `Sample` field round-trips exactly (packed integer arrays, bit-exact float64 logprobs, tuples kept); a
  sample `Sample.validate()` rejects is refused on write and on read.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
import time
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from replay import bounds
from replay.sample import Sample, SampleError, SampleStatus

MAGIC = b"\x89RLDUMP\n"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = frozenset({1, FORMAT_VERSION})
KINDS = ("rollout", "eval")
ROLLOUT_ID_FIELD = "{rollout_id}"

_VERSION = struct.Struct("<H")
FRAME_HEAD = struct.Struct("<cII")  # what precedes each payload: tag, payload length, payload crc32
_CRC = struct.Struct("<I")
_TAG_HEADER, _TAG_SAMPLE, _TAG_TRAILER = b"H", b"S", b"T"

# msgpack extension codes. Packed arrays keep token/logprob lists compact and fast to decode (one memcpy
# instead of one msgpack object per element); tuples keep their type through metadata.
_EXT_TUPLE = 1
_EXT_INT8 = 10
_EXT_INT32 = 11
_EXT_INT64 = 12
_EXT_FLOAT64 = 13
_EXT_TYPECODES = {_EXT_INT8: "b", _EXT_INT32: "i", _EXT_INT64: "q", _EXT_FLOAT64: "d"}
_TYPECODE_EXT = {tc: code for code, tc in _EXT_TYPECODES.items()}
#: the only extension codes a dump may hold (msgpack's own -1 timestamp included: it is refused)
_EXT_CODES = frozenset({_EXT_TUPLE, *_EXT_TYPECODES})
assert _EXT_TUPLE == bounds.EXT_TUPLE and {c: s for c, (s, _) in bounds.PACKED_ARRAYS.items()} == {
    code: array(tc).itemsize for code, tc in _EXT_TYPECODES.items()
}
# array itemsizes for these typecodes are fixed on every platform CPython supports ('i' is 4, 'q' is 8).
_BIG_ENDIAN = sys.byteorder == "big"

SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Sample))
#: The fields a format-1 record holds (every field but slime's `index`).
SAMPLE_FIELDS_V1: tuple[str, ...] = tuple(name for name in SAMPLE_FIELDS if name != "index")


class DumpError(ValueError):
    """A dump that cannot be written or read as it stands; the message names the file and the fault."""


# --------------------------------------------------------------------------------------------- paths


def check_template(template: str) -> str:
    """Return `template` if it holds the `{rollout_id}` placeholder, else raise a DumpError saying so."""
    if ROLLOUT_ID_FIELD not in str(template):
        raise DumpError(
            f"dump path template {template!r} has no {ROLLOUT_ID_FIELD} placeholder; "
            f"use e.g. 'dumps/{ROLLOUT_ID_FIELD}.rld' so each rollout gets its own file"
        )
    return str(template)


def dump_path(template: str, rollout_id: int, *, eval: bool = False) -> Path:
    """The file for `rollout_id` under `template` (`eval_<id>` for eval dumps, as slime/miles name them)."""
    check_template(template)
    key = f"eval_{rollout_id}" if eval else str(rollout_id)
    return Path(str(template).replace(ROLLOUT_ID_FIELD, key))


# ------------------------------------------------------------------------------------------ encoding


def pack_ints(values: Any, order: tuple[str, ...] = ("i", "q")) -> msgpack.ExtType:
    """Pack an int sequence into the narrowest listed array type that holds every value."""
    for typecode in order:
        try:
            packed = array(typecode, values)
        except OverflowError:
            continue
        if _BIG_ENDIAN:
            packed.byteswap()
        return msgpack.ExtType(_TYPECODE_EXT[typecode], packed.tobytes())
    raise OverflowError("an integer does not fit in 64 bits")


def pack_floats(values: Any) -> msgpack.ExtType:
    """Pack a float sequence as a little-endian float64 array (bit-exact: NaN payloads and -0.0 kept)."""
    packed = array("d", values)
    if _BIG_ENDIAN:
        packed.byteswap()
    return msgpack.ExtType(_EXT_FLOAT64, packed.tobytes())


def _default(obj: Any) -> Any:
    """msgpack hook for the few non-msgpack types we keep exactly; anything else is refused by name."""
    if type(obj) is tuple:
        return msgpack.ExtType(_EXT_TUPLE, packb(list(obj)))
    if type(obj) is array and obj.typecode in _TYPECODE_EXT:
        copy = array(obj.typecode, obj)
        if _BIG_ENDIAN:
            copy.byteswap()
        return msgpack.ExtType(_TYPECODE_EXT[obj.typecode], copy.tobytes())
    if isinstance(obj, SampleStatus):
        return obj.value
    raise TypeError(
        f"cannot store a {type(obj).__module__}.{type(obj).__qualname__} ({obj!r:.80}); dumps hold plain "
        "data only: dict, list, tuple, str, bytes, int, float, bool, None (convert numpy/torch values first)"
    )


def packb(obj: Any) -> bytes:
    """msgpack bytes of plain data, with tuples and packed arrays kept as our extension types."""
    # strict_types: a tuple or a str/int subclass goes through _default instead of silently becoming
    # something that reads back as a different type.
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _ext_hook(code: int, data: bytes) -> Any:
    typecode = _EXT_TYPECODES.get(code)
    if typecode is not None:
        values = array(typecode)
        try:
            values.frombytes(data)
        except ValueError as exc:
            raise _SchemaError(f"packed {typecode!r} array of {len(data)} bytes: {exc}") from None
        if _BIG_ENDIAN:
            values.byteswap()
        return values
    if code == _EXT_TUPLE:
        value = _unpackb(data)
        if type(value) is not list:
            raise _SchemaError(f"a tuple extension must hold an array, got {type(value).__name__}")
        return tuple(value)
    raise _SchemaError(f"unknown msgpack extension type {code}")


def _unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True)


def _decode_record(payload: bytes) -> Any:
    """One record's msgpack payload → plain data, within `replay.bounds` (depth, decoded size, known
    extension codes); any fault is a `_SchemaError`, never another exception."""
    try:
        bounds.check_msgpack(payload, allowed_ext=_EXT_CODES)
    except bounds.BoundError as exc:
        raise _SchemaError(str(exc)) from None
    try:
        return _unpackb(payload)
    except _SchemaError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # TypeError: a map key msgpack cannot hash (a list or map used as a key)
        raise _SchemaError(f"not valid msgpack: {exc}") from None


def _check_bounds(payload: bytes, where: str) -> None:
    """Refuse on write a record the reader's bounds would refuse (too deep, too many tiny containers)."""
    try:
        bounds.check_msgpack(payload, allowed_ext=_EXT_CODES)
    except bounds.BoundError as exc:
        raise DumpError(f"{where}: {exc}") from None


class _SchemaError(Exception):
    """Internal: raised while decoding a record; turned into a DumpError that names the file and record."""


def encode_sample(sample: Sample) -> bytes:
    """The record payload of one sample as a dump stores it; unchecked (`write_dump` validates first)."""
    status = sample.status
    record = {
        "group_index": sample.group_index,
        "sample_index": sample.sample_index,
        "prompt": sample.prompt,
        "tokens": pack_ints(sample.tokens),
        "response_length": sample.response_length,
        "loss_mask": pack_ints(sample.loss_mask, ("b", "i", "q")),
        "rollout_log_probs": pack_floats(sample.rollout_log_probs),
        "reward": sample.reward,
        "status": status.value if isinstance(status, SampleStatus) else status,
        "weight_versions": sample.weight_versions,
        "label": sample.label,
        "response": sample.response,
        "advantage": sample.advantage,
        "metadata": sample.metadata,
        "index": sample.index,
    }
    return packb(record)


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_number(value: Any) -> bool:
    return type(value) is float or type(value) is int


def _check_write(sample: Sample, where: str) -> None:
    """Refuse on write what the reader would refuse, so a dump we write is always a dump we can read."""
    try:
        sample.validate()
    except SampleError as exc:
        raise DumpError(f"{where}: {exc}") from None
    problems = []
    for name in ("group_index", "sample_index", "response_length"):
        if not _is_int(getattr(sample, name)):
            problems.append(f"{name} must be an int, got {getattr(sample, name)!r:.60}")
    if type(sample.response) is not str:
        problems.append(f"response must be a str, got {type(sample.response).__name__}")
    if sample.index is not None and not _is_int(sample.index):
        problems.append(f"index must be an int or None, got {sample.index!r:.60}")
    if not _is_number(sample.advantage):
        problems.append(f"advantage must be a float, got {sample.advantage!r:.60}")
    if not _reward_ok(sample.reward):
        problems.append(f"reward must be a float, a dict of str to float, or None; got {sample.reward!r:.80}")
    if type(sample.weight_versions) is not list or not all(type(v) is str for v in sample.weight_versions):
        problems.append(f"weight_versions must be a list of str, got {sample.weight_versions!r:.80}")
    if type(sample.metadata) is not dict:
        problems.append(f"metadata must be a dict, got {type(sample.metadata).__name__}")
    if problems:
        raise DumpError(f"{where}: " + "; ".join(problems))


def _reward_ok(reward: Any) -> bool:
    if reward is None or _is_number(reward):
        return True
    return type(reward) is dict and all(type(k) is str and _is_number(v) for k, v in reward.items())


# ------------------------------------------------------------------------------------------- writing


def encode_frame(tag: bytes, payload: bytes) -> tuple[bytes, int]:
    """One frame (`FRAME_HEAD` then the payload) and the payload's CRC32, which the trailer's chain covers."""
    crc = zlib.crc32(payload)
    return FRAME_HEAD.pack(tag, len(payload), crc) + payload, crc


def write_dump(
    path: str | os.PathLike[str],
    rollout_id: int,
    samples: Iterable[Sample],
    *,
    config_facts: dict[str, Any],
    kind: str = "rollout",
) -> Path:
    """Write one dump atomically and return its path.

    `config_facts` are the facts needed to interpret the dump later (model path, tokenizer path,
    n_samples_per_prompt, ...): plain msgpack-able data, stored verbatim in the header's `config`.
    Every sample is checked (types and `Sample.validate()`) before anything is renamed into place.
    """
    path = Path(path)
    if kind not in KINDS:
        raise DumpError(f"{path}: kind must be one of {KINDS}, got {kind!r}")
    if not _is_int(rollout_id):
        raise DumpError(f"{path}: rollout_id must be an int, got {rollout_id!r}")
    if type(config_facts) is not dict:
        raise DumpError(f"{path}: config_facts must be a dict, got {type(config_facts).__name__}")
    samples = list(samples)
    now = time.time()
    header = {
        "format_version": FORMAT_VERSION,
        "rollout_id": rollout_id,
        "kind": kind,
        "created_at": now,
        "created_at_iso": datetime.fromtimestamp(now, timezone.utc).isoformat(),
        "writer": "rayless",
        "sample_count": len(samples),
        "sample_fields": list(SAMPLE_FIELDS),
        "config": config_facts,
    }
    try:
        header_bytes = packb(header)
    except (TypeError, OverflowError, ValueError) as exc:
        raise DumpError(f"{path}: config_facts cannot be stored: {exc}") from None
    _check_bounds(header_bytes, f"{path}: config_facts")

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(MAGIC + _VERSION.pack(FORMAT_VERSION))
            out.write(encode_frame(_TAG_HEADER, header_bytes)[0])
            chain = 0
            for position, sample in enumerate(samples):
                where = f"{path}: sample #{position} ({getattr(sample, 'group_index', '?')}/{getattr(sample, 'sample_index', '?')})"
                if not isinstance(sample, Sample):
                    raise DumpError(f"{where}: not a Sample but a {type(sample).__name__}")
                _check_write(sample, where)
                try:
                    payload = encode_sample(sample)
                except (TypeError, OverflowError, ValueError) as exc:
                    raise DumpError(f"{where}: {exc}") from None
                _check_bounds(payload, where)
                frame, crc = encode_frame(_TAG_SAMPLE, payload)
                out.write(frame)
                chain = zlib.crc32(_CRC.pack(crc), chain)
            out.write(encode_frame(_TAG_TRAILER, packb({"sample_count": len(samples), "chain": chain}))[0])
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        # Never leave the temporary file behind, whatever interrupted the write (cancellation included).
        with _suppress_oserror():
            os.unlink(tmp_name)
        raise
    _fsync_dir(path.parent)
    return path


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return exc_type is not None and issubclass(exc_type, OSError)


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable; some filesystems (and all non-POSIX ones) cannot open a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class DumpHeader:
    path: Path
    format_version: int
    rollout_id: int
    kind: str
    created_at: float
    sample_count: int
    config: dict[str, Any]
    raw: dict[str, Any]


@dataclass
class Dump:
    header: DumpHeader
    samples: list[Sample]


class _Reader:
    """Reads frames from an open dump, checking sizes against the file so a corrupt length never allocates."""

    def __init__(self, path: Path, stream: BinaryIO, size: int) -> None:
        self.path = path
        self.stream = stream
        self.remaining = size

    def error(self, what: str) -> DumpError:
        return DumpError(f"{self.path}: {what}")

    def read_exact(self, n: int, what: str) -> bytes:
        if n > self.remaining:
            raise self.error(f"truncated: {what} needs {n} bytes, only {self.remaining} left in the file")
        try:
            data = self.stream.read(n)
        except OSError as exc:
            raise self.error(f"cannot read {what}: {exc.strerror or exc}") from None
        if len(data) != n:
            raise self.error(f"truncated while reading {what}")
        self.remaining -= n
        return data

    def frame(self, what: str) -> tuple[bytes, bytes, int]:
        tag, length, crc = FRAME_HEAD.unpack(self.read_exact(FRAME_HEAD.size, f"the frame head of {what}"))
        payload = self.read_exact(length, what)
        if zlib.crc32(payload) != crc:
            raise self.error(f"checksum mismatch in {what} (the file is corrupt: a byte changed on disk)")
        return tag, payload, crc


def _open(path: str | os.PathLike[str]) -> tuple[Path, BinaryIO, int]:
    path = Path(path)
    if path.is_dir():
        raise DumpError(f"{path}: is a directory, not a dump file")
    try:
        stream = open(path, "rb")
    except FileNotFoundError:
        raise DumpError(f"{path}: no such file") from None
    except OSError as exc:
        raise DumpError(f"{path}: cannot open: {exc.strerror}") from None
    size = os.fstat(stream.fileno()).st_size
    if size == 0:
        stream.close()
        raise DumpError(f"{path}: empty file (0 bytes); a complete dump is never empty")
    return path, stream, size


def _read_header(reader: _Reader) -> DumpHeader:
    head_len = len(MAGIC) + _VERSION.size
    if reader.remaining < head_len:
        raise reader.error(f"truncated: {reader.remaining} bytes, too short to be a rayless dump")
    magic = reader.read_exact(len(MAGIC), "the magic bytes")
    if magic != MAGIC:
        hint = ""
        if magic[:2] == b"PK" or magic[:1] == b"\x80":
            hint = " (it looks like a torch/pickle file: import it with `rayless dump convert`)"
        raise reader.error(f"not a rayless dump: wrong magic bytes {magic!r}{hint}")
    (version,) = _VERSION.unpack(reader.read_exact(_VERSION.size, "the format version"))
    if version not in SUPPORTED_VERSIONS:
        raise reader.error(
            f"unsupported dump format version {version}; this rayless reads {sorted(SUPPORTED_VERSIONS)}"
        )
    tag, payload, _ = reader.frame("the header")
    if tag != _TAG_HEADER:
        raise reader.error(f"expected the header frame, found a frame tagged {tag!r}")
    try:
        raw = _decode_record(payload)
    except _SchemaError as exc:
        raise reader.error(f"header: {exc}") from None
    if type(raw) is not dict:
        raise reader.error(f"header must be a map, got {type(raw).__name__}")
    expected = {"format_version": int, "rollout_id": int, "kind": str, "created_at": float,
                "sample_count": int, "sample_fields": list, "config": dict}  # fmt: skip
    for key, typ in expected.items():
        if key not in raw:
            raise reader.error(f"header lacks {key!r}")
        if type(raw[key]) is not typ:
            raise reader.error(f"header {key!r} must be {typ.__name__}, got {raw[key]!r:.60}")
    if raw["format_version"] != version:
        raise reader.error(
            f"header says format version {raw['format_version']}, the file head says {version}"
        )
    if raw["kind"] not in KINDS:
        raise reader.error(f"header kind {raw['kind']!r} is not one of {KINDS}")
    if raw["sample_count"] < 0:
        raise reader.error(f"header sample_count {raw['sample_count']} is negative")
    unknown = sorted((f for f in raw["sample_fields"] if f not in SAMPLE_FIELDS), key=repr)
    if unknown:
        raise reader.error(f"header lists sample fields this rayless does not know: {unknown}")
    return DumpHeader(
        path=reader.path,
        format_version=version,
        rollout_id=raw["rollout_id"],
        kind=raw["kind"],
        created_at=raw["created_at"],
        sample_count=raw["sample_count"],
        config=raw["config"],
        raw=raw,
    )


_STATUS = {status.value: status for status in SampleStatus}
_REQUIRED = {1: frozenset(SAMPLE_FIELDS_V1), 2: frozenset(SAMPLE_FIELDS)}


def _int_list(value: Any, name: str) -> list[int]:
    if type(value) is array and value.typecode in "biq":
        return value.tolist()
    raise _SchemaError(f"{name} must be a packed integer array, got {type(value).__name__}")


def _decode_sample(payload: bytes, version: int) -> Sample:
    record = _decode_record(payload)
    if type(record) is not dict:
        raise _SchemaError(f"a sample record must be a map, got {type(record).__name__}")
    required = _REQUIRED[version]
    if record.keys() != required:
        missing = sorted(required - record.keys())
        unknown = sorted(str(k) for k in record.keys() - required)
        parts = [f"missing {missing}"] if missing else []
        parts += [f"unknown {unknown}"] if unknown else []
        raise _SchemaError(f"fields do not match the schema ({', '.join(parts)})")
    problems = []
    for name in ("group_index", "sample_index", "response_length"):
        if type(record[name]) is not int:
            problems.append(f"{name} must be an int, got {record[name]!r:.60}")
    # Format 1 held text prompts and labels only; format 2 any plain value (chat messages, a dict label).
    names = ("prompt", "response") if version == 1 else ("response",)
    for name in names:
        if type(record[name]) is not str:
            problems.append(f"{name} must be a str, got {type(record[name]).__name__}")
    label = record["label"]
    if version == 1 and label is not None and type(label) is not str:
        problems.append(f"label must be a str or None, got {type(label).__name__}")
    index = record.get("index")
    if index is not None and type(index) is not int:
        problems.append(f"index must be an int or None, got {index!r:.60}")
    if not _is_number(record["advantage"]):
        problems.append(f"advantage must be a float, got {record['advantage']!r:.60}")
    if not _reward_ok(record["reward"]):
        problems.append(
            f"reward must be a float, a dict of str to float, or None; got {record['reward']!r:.80}"
        )
    versions = record["weight_versions"]
    if type(versions) is not list or not all(type(v) is str for v in versions):
        problems.append(f"weight_versions must be a list of str, got {versions!r:.80}")
    if type(record["metadata"]) is not dict:
        problems.append(f"metadata must be a map, got {type(record['metadata']).__name__}")
    status = _STATUS.get(record["status"]) if type(record["status"]) is str else None
    if status is None:
        problems.append(f"status {record['status']!r:.40} is not one of {sorted(_STATUS)}")
    logprobs = record["rollout_log_probs"]
    if type(logprobs) is not array or logprobs.typecode != "d":
        problems.append(f"rollout_log_probs must be a packed float64 array, got {type(logprobs).__name__}")
    if problems:
        raise _SchemaError("; ".join(problems))
    sample = Sample(
        group_index=record["group_index"],
        sample_index=record["sample_index"],
        prompt=record["prompt"],
        tokens=_int_list(record["tokens"], "tokens"),
        response_length=record["response_length"],
        loss_mask=_int_list(record["loss_mask"], "loss_mask"),
        rollout_log_probs=logprobs.tolist(),
        reward=record["reward"],
        status=status,
        weight_versions=versions,
        label=label,
        response=record["response"],
        advantage=record["advantage"],
        metadata=record["metadata"],
        index=index,
    )
    try:
        sample.validate()
    except SampleError as exc:
        raise _SchemaError(f"wrong lengths: {exc}") from None
    return sample


def _iter_records(reader: _Reader, header: DumpHeader) -> Iterator[Sample]:
    chain = 0
    for position in range(header.sample_count):
        what = f"sample #{position} of {header.sample_count}"
        tag, payload, crc = reader.frame(what)
        if tag != _TAG_SAMPLE:
            raise reader.error(f"expected {what}, found a frame tagged {tag!r}")
        try:
            sample = _decode_sample(payload, header.format_version)
        except _SchemaError as exc:
            raise reader.error(f"{what}: {exc}") from None
        chain = zlib.crc32(_CRC.pack(crc), chain)
        yield sample
    tag, payload, _ = reader.frame("the trailer")
    if tag != _TAG_TRAILER:
        raise reader.error(
            f"expected the trailer after {header.sample_count} samples, found a frame tagged {tag!r}"
        )
    try:
        trailer = _decode_record(payload)
    except _SchemaError as exc:
        raise reader.error(f"trailer: {exc}") from None
    if type(trailer) is not dict or trailer.get("sample_count") != header.sample_count:
        raise reader.error(
            f"trailer {trailer!r:.80} disagrees with the header's sample_count {header.sample_count}"
        )
    if trailer.get("chain") != chain:
        raise reader.error("checksum mismatch: sample records were dropped, duplicated or reordered")
    if reader.remaining:
        raise reader.error(f"{reader.remaining} unexpected bytes after the trailer")


def read_header(path: str | os.PathLike[str]) -> DumpHeader:
    """The header only (checked), without reading the samples."""
    path, stream, size = _open(path)
    with stream:
        return _read_header(_Reader(path, stream, size))


def iter_samples(path: str | os.PathLike[str]) -> Iterator[Sample]:
    """Yield the samples one at a time; memory stays at one record whatever the file size.

    Each sample is checked before it is yielded; the file-level checks (count, chained checksum, trailing
    bytes) run after the last one, so a consumer that must be all-or-nothing should use `read_dump`.
    """
    path, stream, size = _open(path)
    with stream:
        reader = _Reader(path, stream, size)
        header = _read_header(reader)
        yield from _iter_records(reader, header)


def read_dump(path: str | os.PathLike[str]) -> Dump:
    """Read and check a whole dump; raises DumpError (naming the file) on any fault."""
    path, stream, size = _open(path)
    with stream:
        reader = _Reader(path, stream, size)
        header = _read_header(reader)
        samples = list(_iter_records(reader, header))
    return Dump(header=header, samples=samples)


def iter_dump(path: str | os.PathLike[str]) -> tuple[DumpHeader, Iterator[Sample]]:
    """The header now and the samples as a stream (for tools that need both without holding every sample)."""
    header = read_header(path)
    return header, iter_samples(path)
