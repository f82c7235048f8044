"""Frames: a 4-byte big-endian length, then a body of at most the receiver's limit; the errors of every contract.

Owns `HEADER`, the limits shared by every contract before a peer is authenticated (`MAX_HELLO_BYTES`,
`MAX_TOKEN_CHARS`), and `ProtocolError` with its kinds. Invariant: a frame over the limit is never written
(`framed` / `check_body_length` raise first) and never read past its header (`check_length` raises after the 4 bytes).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from anyio.streams.buffered import BufferedByteReceiveStream

HEADER = struct.Struct(">I")
#: the most a peer may send before its token is checked: one hello (a real one is ~150 bytes)
MAX_HELLO_BYTES = 4096
#: a token longer than this is refused unread (the coordinator's own are 64 hex characters)
MAX_TOKEN_CHARS = 1024


class ProtocolError(RuntimeError):
    """The peer sent something this side cannot accept (bad frame, unknown message, wrong field)."""


class FrameTooLarge(ProtocolError):
    """A frame is over the configured limit; raised by the sender before writing, by the receiver on read."""


class VersionMismatch(ProtocolError):
    """The peer's hello names another protocol version (the message says both)."""


def framed(body: bytes, limit: int, what: str, hint: str = "") -> bytes:
    """Header + body; FrameTooLarge instead of a frame the peer must refuse."""
    check_body_length(len(body), limit, what, hint)
    return HEADER.pack(len(body)) + body


def check_body_length(length: int, limit: int, what: str, hint: str = "") -> None:
    """FrameTooLarge for a body of `length` bytes over the sender's `limit` (before it is written)."""
    if length > limit:
        raise FrameTooLarge(f"frame of {length} bytes exceeds the {what} limit of {limit} bytes{hint}")


def check_length(length: int, limit: int, what: str = "control-channel") -> None:
    if length > limit:
        raise FrameTooLarge(f"peer announced a frame of {length} bytes, over the {what} limit of {limit} bytes")


def check_hello_length(length: int, limit: int = MAX_HELLO_BYTES) -> None:
    if length > limit:
        raise FrameTooLarge(f"peer announced a first frame of {length} bytes; a hello is at most {limit} bytes")


async def read_frame(stream: BufferedByteReceiveStream, limit: int, what: str) -> bytes:
    """One frame's body, refused after its header when over `limit`. anyio.IncompleteRead / EndOfStream when
    the peer closed."""
    (length,) = HEADER.unpack(await stream.receive_exactly(HEADER.size))
    check_length(length, limit, what)
    return bytes(await stream.receive_exactly(length))


async def read_hello_frame(stream: BufferedByteReceiveStream, limit: int = MAX_HELLO_BYTES) -> bytes:
    """An unauthenticated peer's first frame: refused after its header when over `limit`."""
    (length,) = HEADER.unpack(await stream.receive_exactly(HEADER.size))
    check_hello_length(length, limit)
    return bytes(await stream.receive_exactly(length))
