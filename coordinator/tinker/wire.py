"""The Tinker API's protobuf bodies, read and written by hand: the `forward_backward` request the official SDK
sends as `application/x-protobuf`, and the two results it accepts only as protobuf (`ForwardBackwardOutput`,
`SampleResponse`).

Owns `decode_forward_backward`, `encode_forward_backward_output` and `encode_sample_response`. The field numbers
are the SDK's (`tinker/proto/tinker_public.proto`, package `tinker_public`). Invariants: decoding never reads
past a length it was given and refuses what it cannot represent (image / audio chunks, sparse tensors, groups)
with `WireError` naming the field; it needs no protobuf runtime; unknown fields are skipped, as protobuf does.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

#: DType enum values (tinker_public.DType)
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
_NUMPY = {DTYPE_FLOAT32: np.dtype("<f4"), DTYPE_INT64: np.dtype("<i8"), DTYPE_INT32: np.dtype("<i4")}
STOP_REASONS = {"stop": 0, "length": 1}


class WireError(ValueError):
    """A protobuf body this service cannot read; the message names the field."""


# --------------------------------------------------------------------------------------------- decoding


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        if pos >= len(buf):
            raise WireError("a varint runs past the end of its message")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise WireError("a varint is longer than 10 bytes")


def _fields(buf: memoryview, where: str) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value): an int for varint / fixed fields, the bytes of a length-delimited one."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, pos = _varint(buf, pos)
            yield number, kind, value
        elif kind == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise WireError(f"{where}: field {number} says {size} bytes, past the end of its message")
            yield number, kind, buf[pos:pos + size]
            pos += size
        elif kind in (1, 5):
            width = 8 if kind == 1 else 4
            if pos + width > len(buf):
                raise WireError(f"{where}: field {number} runs past the end of its message")
            yield number, kind, int.from_bytes(buf[pos:pos + width], "little")
            pos += width
        else:
            raise WireError(f"{where}: field {number} has wire type {kind} (groups are not part of the API)")


def _bytes(value: int | memoryview, where: str) -> memoryview:
    if not isinstance(value, memoryview):
        raise WireError(f"{where} must be length-delimited")
    return value


def _text(value: int | memoryview, where: str) -> str:
    try:
        return bytes(_bytes(value, where)).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"{where} is not UTF-8") from None


def _double(value: int | memoryview, where: str) -> float:
    if isinstance(value, memoryview):
        raise WireError(f"{where} must be a double")
    return struct.unpack("<d", value.to_bytes(8, "little"))[0]


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class Datum:
    """One `Datum`: its text tokens and its `loss_fn_inputs` as flat numpy arrays with their shapes."""

    tokens: list[int] = field(default_factory=list)
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    loss_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False
    data: list[Datum] = field(default_factory=list)


def _tensor(buf: memoryview, where: str, max_elements: int) -> np.ndarray:
    dense: memoryview | None = None
    dtype = 0
    shape: list[int] = []
    for number, _kind, value in _fields(buf, where):
        if number == 1:
            dense = _bytes(value, f"{where}.dense")
        elif number == 2:
            raise WireError(f"{where}: sparse tensors are not supported by this service; send it dense")
        elif number == 3 and isinstance(value, int):
            dtype = value
        elif number == 4:
            if isinstance(value, int):
                shape.append(_signed(value))
            else:
                pos = 0
                while pos < len(value):
                    dim, pos = _varint(value, pos)
                    shape.append(_signed(dim))
    if dtype not in _NUMPY:
        raise WireError(f"{where}: dtype {dtype} is not float32, int64 or int32")
    raw = bytes(dense or b"")
    item = _NUMPY[dtype].itemsize
    if len(raw) % item or len(raw) // item > max_elements:
        raise WireError(f"{where}: {len(raw)} bytes are not a whole number of at most {max_elements} elements")
    array = np.frombuffer(raw, dtype=_NUMPY[dtype])
    if shape and int(np.prod(shape)) != array.size:
        raise WireError(f"{where}: shape {shape} does not hold its {array.size} elements")
    return array


def _map_entry(buf: memoryview, where: str) -> tuple[str, int | memoryview | None]:
    key, value = "", None
    for number, _kind, item in _fields(buf, where):
        if number == 1:
            key = _text(item, f"{where} key")
        elif number == 2:
            value = item
    return key, value


def _datum(buf: memoryview, where: str, max_tokens: int) -> Datum:
    datum = Datum()
    for number, _kind, value in _fields(buf, where):
        if number == 1:
            for chunk_number, _k, chunk in _fields(_bytes(value, f"{where}.model_input"), f"{where}.model_input"):
                if chunk_number != 1:
                    what = {2: "image", 3: "audio (dmel)"}.get(chunk_number, f"field {chunk_number}")
                    raise WireError(f"{where}: {what} chunks are not supported by this service (text only)")
                for token_number, _t, tokens in _fields(_bytes(chunk, f"{where}.encoded_text"), where):
                    if token_number == 1:
                        raw = bytes(_bytes(tokens, f"{where}.encoded_text.tokens"))
                        if len(raw) % 4:
                            raise WireError(f"{where}: encoded_text.tokens is not int32 bytes")
                        datum.tokens.extend(np.frombuffer(raw, dtype="<i4").tolist())
                if len(datum.tokens) > max_tokens:
                    raise WireError(f"{where}: over {max_tokens} tokens")
        elif number == 2:
            name, tensor = _map_entry(_bytes(value, f"{where}.loss_fn_inputs"), f"{where}.loss_fn_inputs")
            datum.inputs[name] = _tensor(_bytes(tensor or memoryview(b""), f"{where}.loss_fn_inputs[{name!r}]"),
                                         f"{where}.loss_fn_inputs[{name!r}]", max_tokens)
    return datum


def decode_forward_backward(body: bytes, *, max_datums: int, max_tokens: int) -> ForwardBackwardRequest:
    """The SDK's `ForwardBackwardRequest`; more than `max_datums` data or `max_tokens` tokens in one datum is
    refused as it is read."""
    request = ForwardBackwardRequest()
    buf = memoryview(body)
    for number, _kind, value in _fields(buf, "ForwardBackwardRequest"):
        if number == 1:
            request.model_id = _text(value, "model_id")
        elif number == 2 and isinstance(value, int):
            request.seq_id = value - (1 << 64) if value >= 1 << 63 else value
        elif number == 3:
            if len(request.data) >= max_datums:
                raise WireError(f"over {max_datums} data in one forward_backward request (the service's "
                                "--max-batch-datums)")
            request.data.append(_datum(_bytes(value, "data"), f"data[{len(request.data)}]", max_tokens))
        elif number == 4:
            request.loss_fn = _text(value, "loss_fn")
        elif number == 5:
            key, number_value = _map_entry(_bytes(value, "loss_fn_config"), "loss_fn_config")
            request.loss_config.setdefault(key, _double(number_value or 0, f"loss_fn_config[{key!r}]"))
        elif number == 6 and isinstance(value, int):
            request.forward_only = bool(value)
        elif number == 7:
            key, config = _map_entry(_bytes(value, "loss_fn_config_v2"), "loss_fn_config_v2")
            for inner, _k, item in _fields(_bytes(config or memoryview(b""), key), f"loss_fn_config_v2[{key!r}]"):
                request.loss_config[key] = (_double(item, key) if inner == 1 else _text(item, key))
    return request


# --------------------------------------------------------------------------------------------- encoding


def _key(number: int, kind: int) -> bytes:
    return _encode_varint(number << 3 | kind)


def _encode_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_field(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _encode_varint(len(payload)) + payload


def _varint_field(number: int, value: int) -> bytes:
    return _key(number, 0) + _encode_varint(value) if value else b""


def _batched_float32(rows: list[list[float]]) -> bytes:
    """A `BatchedTensor` of float32 rows: the bytes, then each row's byte offset (n + 1 of them)."""
    arrays = [np.asarray(row, dtype="<f4") for row in rows]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
    data = b"".join(a.tobytes() for a in arrays)
    return _length_field(1, data) + _length_field(2, offsets.tobytes()) + _varint_field(3, DTYPE_FLOAT32)


def encode_forward_backward_output(outputs: dict[str, list[list[float]]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput`: one `ArrayRecord` holding, per name, one float32 row per datum."""
    count = len(next(iter(outputs.values()))) if outputs else 0
    record = b"".join(_length_field(2, _length_field(1, name.encode()) + _length_field(2, _batched_float32(rows)))
                      for name, rows in outputs.items()) + _varint_field(3, count)
    body = _length_field(1, b"ArrayRecord") + _length_field(2, record)
    for name, value in metrics.items():
        body += _length_field(3, _length_field(1, name.encode()) + _key(2, 1) + struct.pack("<d", float(value)))
    return body


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


def encode_sample_response(sequences: list[SampledSequence], prompt_logprobs: list[float | None] | None) -> bytes:
    """`SampleResponse`: each sequence's tokens (int32) and logprobs (float32); the prompt's logprobs with NaN
    where none is defined (the first token), as the SDK reads them."""
    body = b""
    for seq in sequences:
        inner = (_varint_field(1, STOP_REASONS[seq.stop_reason])
                 + _length_field(2, np.asarray(seq.tokens, dtype="<i4").tobytes())
                 + _length_field(3, np.asarray(seq.logprobs, dtype="<f4").tobytes()))
        body += _length_field(1, inner)
    if prompt_logprobs is not None:
        values = np.asarray([np.nan if v is None else v for v in prompt_logprobs], dtype="<f4")
        body += _length_field(2, values.tobytes())
    return body
