"""The rayless rollout dump format: its layout, the record codec, the writer, path templates.

Owns the on-disk layout of one rollout (or eval) dump — MAGIC | version | frame 'H' (header) | frames 'S' (one
per sample) | frame 'T' (trailer: count and chained CRC), each frame tag | length | CRC32 | msgpack payload —
the msgpack codec of its records (our extension types, bounded decoding), and writing format 2; the streaming
reader (formats 2 and 1) is `replay.reader`. Each rule the reader enforces is refused on write here, so a
dump we write is a dump we can read. The layout in full: docs/replay.md.

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
from collections.abc import Iterable
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgpack

from replay import bounds
from replay.sample import Sample, SampleError, SampleStatus

if TYPE_CHECKING:
    from workers.boundary.json_input import JsonObject

MAGIC = b"\x89RLDUMP\n"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = frozenset({1, FORMAT_VERSION})
KINDS = ("rollout", "eval")
ROLLOUT_ID_FIELD = "{rollout_id}"

VERSION_HEAD = struct.Struct("<H")
FRAME_HEAD = struct.Struct("<cII")  # what precedes each payload: tag, payload length, payload crc32
CRC = struct.Struct("<I")
TAG_HEADER, TAG_SAMPLE, TAG_TRAILER = b"H", b"S", b"T"

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
#: Fields a record holds only when set (on-policy distillation's teacher logprobs; a VLM sample's processed
#: images, `multimodal_train_inputs`). `multimodal_inputs` (the raw images) is never written: a replay trains on
#: the processed tensors, so it needs neither the images nor the data files.
OPTIONAL_SAMPLE_FIELDS: frozenset[str] = frozenset({"teacher_log_probs", "opd_reverse_kl", "multimodal_inputs",
                                                   "multimodal_train_inputs"})
#: The fields a format-1 record holds (every field but slime's `index`).
SAMPLE_FIELDS_V1: tuple[str, ...] = tuple(name for name in SAMPLE_FIELDS
                                          if name != "index" and name not in OPTIONAL_SAMPLE_FIELDS)


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


def pack_ints(values: Iterable[int], order: tuple[str, ...] = ("i", "q")) -> msgpack.ExtType:
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


def pack_floats(values: Iterable[float]) -> msgpack.ExtType:
    """Pack a float sequence as a little-endian float64 array (bit-exact: NaN payloads and -0.0 kept)."""
    packed = array("d", values)
    if _BIG_ENDIAN:
        packed.byteswap()
    return msgpack.ExtType(_EXT_FLOAT64, packed.tobytes())


def _default(obj: object) -> msgpack.ExtType | str:
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


def packb(obj: object) -> bytes:
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
            raise SchemaError(f"packed {typecode!r} array of {len(data)} bytes: {exc}") from None
        if _BIG_ENDIAN:
            values.byteswap()
        return values
    if code == _EXT_TUPLE:
        value = _unpackb(data)
        if type(value) is not list:
            raise SchemaError(f"a tuple extension must hold an array, got {type(value).__name__}")
        return tuple(value)
    raise SchemaError(f"unknown msgpack extension type {code}")


def _unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True)


def decode_record(payload: bytes) -> Any:
    """One record's msgpack payload → plain data, within `replay.bounds` (depth, decoded size, known
    extension codes); any fault is a `SchemaError`, never another exception."""
    try:
        bounds.check_msgpack(payload, allowed_ext=_EXT_CODES)
    except bounds.BoundError as exc:
        raise SchemaError(str(exc)) from None
    try:
        return _unpackb(payload)
    except SchemaError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        # TypeError: a map key msgpack cannot hash (a list or map used as a key)
        raise SchemaError(f"not valid msgpack: {exc}") from None


def _check_bounds(payload: bytes, where: str) -> None:
    """Refuse on write a record the reader's bounds would refuse (too deep, too many tiny containers)."""
    try:
        bounds.check_msgpack(payload, allowed_ext=_EXT_CODES)
    except bounds.BoundError as exc:
        raise DumpError(f"{where}: {exc}") from None


class SchemaError(Exception):
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
    if sample.teacher_log_probs is not None:  # absent, not null: dumps without distillation read as before
        record["teacher_log_probs"] = pack_floats(sample.teacher_log_probs)
    if sample.opd_reverse_kl is not None:  # top-k OPD's term: a replay trains on it as the run did
        record["opd_reverse_kl"] = pack_floats(sample.opd_reverse_kl)
    if sample.multimodal_train_inputs:  # a VLM sample: its images as the trainer takes them
        record["multimodal_train_inputs"] = pack_images(sample.multimodal_train_inputs)
    return packb(record)


def pack_images(inputs: dict[str, object]) -> dict[str, object]:
    """`multimodal_train_inputs` (`pixel_values` [patches, features], `image_grid_thw` [images, 3]: tensors or
    arrays; or a dump's own form) as packed arrays: pixel values as float64 (float32 round-trips exactly), the
    grid's ints."""
    import numpy

    pixels = numpy.asarray(getattr(inputs["pixel_values"], "numpy", lambda: inputs["pixel_values"])())
    shape = inputs.get("pixel_shape")
    if isinstance(shape, list):  # a replayed sample's flat values
        pixels = pixels.reshape([int(n) for n in shape])
    grid = numpy.asarray(getattr(inputs["image_grid_thw"], "numpy", lambda: inputs["image_grid_thw"])())
    return {"pixel_values": pack_floats(pixels.astype("float64").reshape(-1).tolist()),
            "pixel_shape": [int(n) for n in pixels.shape], "image_grid_thw": pack_ints(grid.reshape(-1).tolist())}


def _is_int(value: object) -> bool:
    return type(value) is int


def is_number(value: object) -> bool:
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
    if not is_number(sample.advantage):
        problems.append(f"advantage must be a float, got {sample.advantage!r:.60}")
    if not reward_ok(sample.reward):
        problems.append(f"reward must be a float, a dict of str to float, or None; got {sample.reward!r:.80}")
    if type(sample.weight_versions) is not list or not all(type(v) is str for v in sample.weight_versions):
        problems.append(f"weight_versions must be a list of str, got {sample.weight_versions!r:.80}")
    if type(sample.metadata) is not dict:
        problems.append(f"metadata must be a dict, got {type(sample.metadata).__name__}")
    if problems:
        raise DumpError(f"{where}: " + "; ".join(problems))


def reward_ok(reward: object) -> bool:
    if reward is None or is_number(reward):
        return True
    return type(reward) is dict and all(type(k) is str and is_number(v) for k, v in reward.items())


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
    config_facts: JsonObject,
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
            out.write(MAGIC + VERSION_HEAD.pack(FORMAT_VERSION))
            out.write(encode_frame(TAG_HEADER, header_bytes)[0])
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
                frame, crc = encode_frame(TAG_SAMPLE, payload)
                out.write(frame)
                chain = zlib.crc32(CRC.pack(crc), chain)
            out.write(encode_frame(TAG_TRAILER, packb({"sample_count": len(samples), "chain": chain}))[0])
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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
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
