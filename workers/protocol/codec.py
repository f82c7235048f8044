"""The control channel's msgpack codec: plain values, tensors as the `TENSOR_EXT` extension, a sample's per-token
arrays as the `workers.protocol.arrays` extensions (packed little-endian bytes), never pickle.

Owns the tensor extension (`[dtype name, shape, raw bytes]`) and the hooks the control channel's family gives
msgspec, plus `pack` / `unpack` of untyped bodies. Imports no torch: only tensors that exist are encoded, and a
tensor is decoded by importing torch then. Invariant: a tensor's dtype, shape and byte count are checked before
any arithmetic on its shape or any allocation, so a hostile shape costs no more than its bytes.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import msgspec

from workers.protocol.arrays import EXT_CODES, Kind, PackedArray, PackedArrayError
from workers.protocol.frames import ProtocolError

TENSOR_EXT = 1
#: tensors of more dimensions, or dimensions over this size, are refused before any arithmetic on them
MAX_TENSOR_DIMS = 64
MAX_TENSOR_DIM = 1 << 48

_Shape = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TENSOR_DIM)]], msgspec.Meta(max_length=MAX_TENSOR_DIMS)
]
_TENSOR = msgspec.msgpack.Decoder(tuple[str, _Shape, bytes])
_TENSOR_PARTS = msgspec.msgpack.Encoder()


def encode_hook(obj: Any) -> Any:
    """What msgspec cannot encode by itself: per-token arrays, tensors, and subclasses of plain scalars (numpy's
    too)."""
    if isinstance(obj, PackedArray):
        # Packed here, as the frame is written: the coordinator holds one sample's packed bytes besides the frame.
        data = obj.packed()
        if obj.kind is Kind.TOKENS and len(data) and not obj.sign_checked:
            import numpy as np  # not at import time: `workers.protocol.arrays` says why

            lowest = int(np.frombuffer(data, dtype=obj.kind.dtype).min())
            if lowest < 0:
                raise ProtocolError(f"token id {lowest} is negative (ids are 0..2**31-1)")
        return msgspec.msgpack.Ext(obj.kind.ext_code, data)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        tensor = obj.detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        # A uint8 view gives the raw bytes of any dtype (bfloat16 has no numpy equivalent).
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return msgspec.msgpack.Ext(TENSOR_EXT, _TENSOR_PARTS.encode((dtype, list(tensor.shape), raw)))
    for scalar in (int, float, str):  # an IntEnum, a str subclass
        if isinstance(obj, scalar):
            return scalar(obj)
    item = getattr(obj, "item", None)
    if type(obj).__module__ == "numpy" and callable(item):  # numpy.float64 and friends
        return item()
    raise ProtocolError(f"cannot encode a {type(obj).__name__} on the control channel")


def ext_hook(code: int, data: memoryview) -> Any:
    if code in EXT_CODES:  # a view of the frame's buffer, kept: the rank's arrays are not copied out of it
        try:
            return PackedArray.from_ext(code, data)
        except PackedArrayError as exc:
            raise ProtocolError(str(exc)) from None
    if code != TENSOR_EXT:
        raise ProtocolError(f"unknown msgpack ext type {code} on the control channel")
    try:
        dtype_name, shape, raw = _TENSOR.decode(data)
    except msgspec.MsgspecError as exc:
        # checked before multiplying: a product of 100,000 huge integers costs quadratic time
        raise ProtocolError(
            f"malformed tensor payload: the shape must be at most {MAX_TENSOR_DIMS} sizes in "
            f"0..{MAX_TENSOR_DIM} and the data bytes ({exc})"
        ) from None
    import torch

    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ProtocolError(f"unknown tensor dtype {dtype_name!r:.80}")
    count = 1
    for size in shape:
        count *= size
    expected = count * torch.empty((), dtype=dtype).element_size()
    if len(raw) != expected:
        raise ProtocolError(f"tensor {dtype_name}{shape} needs {expected} bytes, got {len(raw)}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


_ENCODER = msgspec.msgpack.Encoder(enc_hook=encode_hook)
_DECODER = msgspec.msgpack.Decoder(ext_hook=ext_hook)


def pack(obj: Any) -> bytes:
    """msgpack body of `obj` (plain values, messages, tensors as ext types)."""
    try:
        return _ENCODER.encode(obj)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"cannot encode on the control channel: {exc}"[:300]) from None


def unpack(body: bytes) -> Any:
    """The plain values of a body (tensors decoded); ProtocolError for anything malformed."""
    try:
        return _DECODER.decode(body)
    except ProtocolError:
        raise
    except Exception as exc:  # msgspec's errors, and RecursionError for nesting past the interpreter's limit
        raise ProtocolError(f"malformed frame body: {exc}"[:300]) from None
