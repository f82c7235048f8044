"""Hostile image files for the image boundary's tests, made without decoding (or allocating) what they claim.

A PNG is written chunk by chunk, so a 20k x 20k header costs a few bytes and a decompression bomb (a header
declaring far more pixels than its compressed data looks like) costs kilobytes.
"""

from __future__ import annotations

import io
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png(width: int, height: int, rows: int, *, bit_depth: int = 8, color_type: int = 2) -> bytes:
    """A PNG declaring `width` x `height`, with `rows` rows of zero pixel data (zlib compresses them to almost
    nothing): `rows < height` is a truncated image, a large declared size a decompression bomb."""
    channels = {0: 1, 2: 3, 6: 4}[color_type]
    row = b"\x00" + bytes(width * channels * bit_depth // 8)
    compressor = zlib.compressobj(9)
    data = b"".join(compressor.compress(row) for _ in range(rows)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def solid_png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()
