"""A control-channel frame as parts sent one after another: the message's msgpack with each large per-token
array left where it lies (a sample's packed bytes), instead of copied into one fresh frame buffer.

Owns `encode_parts`. A rollout's frame is tens of MiB; writing it into a new buffer costs more in first-touch
page faults than in copying, and the sender then copies it again into the socket. Here the message is encoded
with a 16-byte random placeholder for each array of `PART_MIN_BYTES` or more (a small skeleton), and the parts
are the skeleton's pieces, each array's extension header and its bytes.

Invariant: the parts joined are exactly the family's `encode` of the message (the same msgpack, the same
extension headers: `ext_header` writes msgpack's smallest form, as msgspec does), so the peer reads one frame as
before; the size limit is checked on the whole before anything is sent; the token's sign check runs as it does
for a whole frame (`codec.encode_hook` packs every array).
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Callable

import msgspec

from workers.protocol.arrays import PackedArray
from workers.protocol.frames import HEADER, ProtocolError, check_body_length
from workers.protocol.messages import Family, Message

#: a packed array of at least this many bytes is a part of its own; smaller ones stay in the skeleton
PART_MIN_BYTES = 1024
_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
_TOKEN_BYTES = 16  # a placeholder is fixext 16: 0xd8, the code, the token

Part = bytes | bytearray | memoryview


def ext_header(code: int, length: int) -> bytes:
    """msgpack's header of an extension of `length` bytes, in the smallest form (as msgspec writes it)."""
    if length in _FIXEXT:
        return struct.pack(">Bb", _FIXEXT[length], code)
    if length < 1 << 8:
        return struct.pack(">BBb", 0xC7, length, code)
    if length < 1 << 16:
        return struct.pack(">BHb", 0xC8, length, code)
    return struct.pack(">BIb", 0xC9, length, code)


def encode_parts(family: Family, message: Message, limit: int, enc_hook: Callable[[object], object]) -> list[Part]:
    """`family.encode(message, limit)`'s bytes as parts (the first starts with the length header); the family's
    error (FrameTooLarge over `limit`) as `encode` raises it."""
    token = secrets.token_bytes(_TOKEN_BYTES)
    arrays: list[tuple[int, memoryview]] = []

    def hook(obj: object) -> object:
        encoded = enc_hook(obj)
        if isinstance(obj, PackedArray) and isinstance(encoded, msgspec.msgpack.Ext):
            data = memoryview(encoded.data)
            if data.nbytes >= PART_MIN_BYTES:
                arrays.append((encoded.code, data))
                return msgspec.msgpack.Ext(encoded.code, token)
        return encoded

    try:
        skeleton = bytearray(HEADER.size)
        msgspec.msgpack.Encoder(enc_hook=hook).encode_into(message, skeleton, HEADER.size)
        if skeleton.count(token) != len(arrays):  # 2**-128 a position: a collision is refused, never misread
            raise ProtocolError("a placeholder collided with the message's own bytes; encode again")
        headers = [ext_header(code, data.nbytes) for code, data in arrays]
        length = (len(skeleton) - HEADER.size - len(arrays) * (2 + _TOKEN_BYTES)
                  + sum(len(header) for header in headers) + sum(data.nbytes for _, data in arrays))
        check_body_length(length, limit, family.name.replace(" ", "-"), family.limit_hint)
        HEADER.pack_into(skeleton, 0, length)
    except ProtocolError as exc:
        raise (exc if isinstance(exc, family.error) else family.error(str(exc))) from None
    except Exception as exc:
        raise family.error(f"{family.name}: cannot encode a {message.kind} message: {exc}"[:300]) from None
    view = memoryview(skeleton)
    parts: list[Part] = []
    start = 0
    for (code, data), header in zip(arrays, headers, strict=True):
        at = skeleton.find(bytes((0xD8, code & 0xFF)) + token, start)
        parts += [view[start:at], header, data]
        start = at + 2 + _TOKEN_BYTES
    parts.append(view[start:])
    return parts
