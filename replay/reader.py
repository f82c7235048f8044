"""The streaming reader of the rayless dump format: every frame, record and count checked as it is read.

Owns reading a dump file (`read_dump`, `iter_samples`, `read_header`, `iter_dump`) and the read-side schema
of a sample record, in formats 2 and 1; the layout and the writer are `replay.format`'s. Invariants: every
fault of a file, checksums valid or not, is a `DumpError` naming the file, never another exception or a
crash; a corrupt length never allocates (sizes are checked against the file); nothing read is ever
executed (msgpack only, each record within `replay.bounds`); memory stays at one record while streaming.
"""

from __future__ import annotations

import os
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from replay.format import (
    CRC,
    FRAME_HEAD,
    KINDS,
    MAGIC,
    OPTIONAL_SAMPLE_FIELDS,
    SAMPLE_FIELDS,
    SAMPLE_FIELDS_V1,
    SUPPORTED_VERSIONS,
    TAG_HEADER,
    TAG_SAMPLE,
    TAG_TRAILER,
    VERSION_HEAD,
    DumpError,
    SchemaError,
    decode_record,
    is_number,
    reward_ok,
)
from replay.packed_list import from_packed_array
from replay.sample import Sample, SampleError, SampleStatus


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
    head_len = len(MAGIC) + VERSION_HEAD.size
    if reader.remaining < head_len:
        raise reader.error(f"truncated: {reader.remaining} bytes, too short to be a rayless dump")
    magic = reader.read_exact(len(MAGIC), "the magic bytes")
    if magic != MAGIC:
        hint = ""
        if magic[:2] == b"PK" or magic[:1] == b"\x80":
            hint = " (it looks like a torch/pickle file: import it with `rayless dump convert`)"
        raise reader.error(f"not a rayless dump: wrong magic bytes {magic!r}{hint}")
    (version,) = VERSION_HEAD.unpack(reader.read_exact(VERSION_HEAD.size, "the format version"))
    if version not in SUPPORTED_VERSIONS:
        raise reader.error(
            f"unsupported dump format version {version}; this rayless reads {sorted(SUPPORTED_VERSIONS)}"
        )
    tag, payload, _ = reader.frame("the header")
    if tag != TAG_HEADER:
        raise reader.error(f"expected the header frame, found a frame tagged {tag!r}")
    try:
        raw = decode_record(payload)
    except SchemaError as exc:
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
_REQUIRED = {1: frozenset(SAMPLE_FIELDS_V1), 2: frozenset(SAMPLE_FIELDS) - OPTIONAL_SAMPLE_FIELDS}


def _int_list(value: object, name: str) -> list[int]:
    if type(value) is array and value.typecode in "biq":
        return from_packed_array(value)
    raise SchemaError(f"{name} must be a packed integer array, got {type(value).__name__}")


def _decode_sample(payload: bytes, version: int) -> Sample:
    record = decode_record(payload)
    if type(record) is not dict:
        raise SchemaError(f"a sample record must be a map, got {type(record).__name__}")
    required = _REQUIRED[version]
    optional = OPTIONAL_SAMPLE_FIELDS if version == 2 else frozenset()
    if record.keys() - optional != required:
        missing = sorted(required - record.keys())
        unknown = sorted(str(k) for k in record.keys() - required - optional)
        parts = [f"missing {missing}"] if missing else []
        parts += [f"unknown {unknown}"] if unknown else []
        raise SchemaError(f"fields do not match the schema ({', '.join(parts)})")
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
    if not is_number(record["advantage"]):
        problems.append(f"advantage must be a float, got {record['advantage']!r:.60}")
    if not reward_ok(record["reward"]):
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
    teacher = record.get("teacher_log_probs")
    if teacher is not None and (type(teacher) is not array or teacher.typecode != "d"):
        problems.append(f"teacher_log_probs must be a packed float64 array, got {type(teacher).__name__}")
    reverse_kl = record.get("opd_reverse_kl")
    if reverse_kl is not None and (type(reverse_kl) is not array or reverse_kl.typecode != "d"):
        problems.append(f"opd_reverse_kl must be a packed float64 array, got {type(reverse_kl).__name__}")
    images = record.get("multimodal_train_inputs")
    train_inputs = None
    if images is not None:
        train_inputs = _images(images, problems)
    if problems:
        raise SchemaError("; ".join(problems))
    sample = Sample(
        group_index=record["group_index"],
        sample_index=record["sample_index"],
        prompt=record["prompt"],
        tokens=_int_list(record["tokens"], "tokens"),
        response_length=record["response_length"],
        loss_mask=_int_list(record["loss_mask"], "loss_mask"),
        rollout_log_probs=from_packed_array(logprobs),
        reward=record["reward"],
        status=status,
        weight_versions=versions,
        label=label,
        response=record["response"],
        advantage=record["advantage"],
        metadata=record["metadata"],
        index=index,
        teacher_log_probs=None if teacher is None else from_packed_array(teacher),
        opd_reverse_kl=None if reverse_kl is None else from_packed_array(reverse_kl),
        multimodal_train_inputs=train_inputs,
    )
    try:
        sample.validate()
    except SampleError as exc:
        raise SchemaError(f"wrong lengths: {exc}") from None
    return sample


def _images(value: object, problems: list[str]) -> dict[str, object] | None:
    """A record's `multimodal_train_inputs` back as the trainer takes them (`workers.protocol.wire_images`):
    float64 pixel values with their [patches, features] shape, and the grid as [t, h, w] rows."""
    if type(value) is not dict or set(value) != {"pixel_values", "pixel_shape", "image_grid_thw"}:
        problems.append("multimodal_train_inputs must be a map of pixel_values, pixel_shape and image_grid_thw")
        return None
    pixels, shape, grid = value["pixel_values"], value["pixel_shape"], value["image_grid_thw"]
    if type(pixels) is not array or pixels.typecode != "d":
        problems.append("multimodal_train_inputs.pixel_values must be a packed float64 array")
    elif type(shape) is not list or len(shape) != 2 or any(type(n) is not int or n < 1 for n in shape) \
            or shape[0] * shape[1] != len(pixels):
        problems.append(f"multimodal_train_inputs.pixel_shape {shape!r:.40} does not fit its {len(pixels)} values")
    elif type(grid) is not array or grid.typecode not in "biq" or not grid or len(grid) % 3:
        problems.append("multimodal_train_inputs.image_grid_thw must be packed (t, h, w) integer triples")
    else:
        rows = grid.tolist()
        return {"pixel_values": pixels, "pixel_shape": shape,
                "image_grid_thw": [rows[i:i + 3] for i in range(0, len(rows), 3)]}
    return None


def _iter_records(reader: _Reader, header: DumpHeader) -> Iterator[Sample]:
    chain = 0
    for position in range(header.sample_count):
        what = f"sample #{position} of {header.sample_count}"
        tag, payload, crc = reader.frame(what)
        if tag != TAG_SAMPLE:
            raise reader.error(f"expected {what}, found a frame tagged {tag!r}")
        try:
            sample = _decode_sample(payload, header.format_version)
        except SchemaError as exc:
            raise reader.error(f"{what}: {exc}") from None
        chain = zlib.crc32(CRC.pack(crc), chain)
        yield sample
    tag, payload, _ = reader.frame("the trailer")
    if tag != TAG_TRAILER:
        raise reader.error(
            f"expected the trailer after {header.sample_count} samples, found a frame tagged {tag!r}"
        )
    try:
        trailer = decode_record(payload)
    except SchemaError as exc:
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
