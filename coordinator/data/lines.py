"""Rows of a prompt or eval data file, read through the boundary layer: JSONL line by line, Parquet by batches.

Owns how one line (or row) of a data file becomes a JSON object. Invariants: memory is bounded by one line
(at most `max_line_bytes`, never more: a longer line is skipped in chunks, not read whole) or one Parquet
batch; every line is decoded by `workers.boundary.json_input.decode_json` within `line_limits`, so no line
can recurse, expand past its limits or raise anything but `BoundaryError`; each row is yielded with its place
(`file:line`, or `file: row N`), and a bad row is yielded as its `BoundaryError` so a checker can go on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from workers.boundary.errors import BoundaryError
from workers.boundary.json_input import JsonLimits, JsonValue, decode_json

#: Default of `--data-max-line-bytes`: one prompt line (or Parquet row) may hold 1 MiB, about 250k tokens of
#: text, more than any context length; a longer line is refused at start-up, naming the flag that raises it.
DEFAULT_MAX_LINE_BYTES = 1 << 20
LIMIT_FLAG = "--data-max-line-bytes"
MAX_DEPTH = 32  # nesting of one record: chat messages with tool calls need ~6
PARQUET_BATCH_ROWS = 1024
_CHUNK = 1 << 16

Row = dict[str, Any]


def line_limits(max_line_bytes: int) -> JsonLimits:
    return JsonLimits(max_bytes=max_line_bytes, max_depth=MAX_DEPTH, max_items=max(1, max_line_bytes))


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() in {".parquet", ".pq"}


def iter_rows(path: Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[tuple[str, Row | BoundaryError]]:
    """(place, row or the reason it is refused) for every non-blank line / row; BoundaryError when the file
    cannot be opened or read at all."""
    try:
        if is_parquet(path):
            yield from _parquet_rows(path, max_line_bytes)
            return
        with path.open("rb") as handle:
            yield from _jsonl_rows(path, handle, max_line_bytes)
    except OSError as error:
        raise BoundaryError(str(path), f"cannot be read: {error.strerror or error}") from None


def _jsonl_rows(path: Path, handle: BinaryIO, max_line_bytes: int) -> Iterator[tuple[str, Row | BoundaryError]]:
    limits = line_limits(max_line_bytes)
    line_number = 0
    while True:
        line = handle.readline(max_line_bytes + 1)
        if not line:
            return
        line_number += 1
        where = f"{path}:{line_number}"
        if len(line) > max_line_bytes and not line.endswith(b"\n"):
            length = len(line) + _skip_line(handle)
            yield where, BoundaryError(where, f"a line of {length} bytes is over the limit of {max_line_bytes} "
                                              f"bytes (raise it with {LIMIT_FLAG})")
            continue
        if not line.strip():
            continue
        yield where, decode_row(line, where, limits)


def _skip_line(handle: BinaryIO) -> int:
    """Read the rest of an over-long line in chunks (memory stays one chunk); its length."""
    skipped = 0
    while True:
        chunk = handle.readline(_CHUNK)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


def decode_row(line: bytes, where: str, limits: JsonLimits) -> Row | BoundaryError:
    """One JSONL line as a JSON object, or why not (as a value: the caller decides whether to go on)."""
    try:
        row = decode_json(line, where, limits)
    except BoundaryError as error:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as bad:
            return BoundaryError(where, f"not UTF-8 text (byte {bad.start} of the line is {line[bad.start]:#04x})")
        if "out of range" not in error.reason or line.count(b"[") + line.count(b"{") > limits.max_depth:
            return error
        row = _with_big_numbers(line, where)  # JSON has no size limit on numbers; data sets hold big ids
        if isinstance(row, BoundaryError):
            return row
    if not isinstance(row, dict):
        return BoundaryError(where, f"each line must be a JSON object, got {type(row).__name__}")
    return row


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _with_big_numbers(line: bytes, where: str) -> Row | BoundaryError:
    """A shallow line (its brackets fewer than the depth limit, so the stdlib parser's recursion is bounded)
    holding integers beyond 64 bits or floats beyond double range, which msgspec refuses: as `json` reads them."""
    try:
        return json.loads(line, parse_constant=_refuse_constant)
    except ValueError as error:
        return BoundaryError(where, f"not valid JSON ({error})")


def _parquet_rows(path: Path, max_row_bytes: int) -> Iterator[tuple[str, Row | BoundaryError]]:
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS)
        number = 0
        for batch in batches:
            for row in batch.to_pylist():
                number += 1
                where = f"{path}: row {number}"
                size = bounded_size(row, max_row_bytes)
                if size > max_row_bytes:
                    yield where, BoundaryError(where, f"a row of more than {max_row_bytes} bytes is over the "
                                                      f"limit (raise it with {LIMIT_FLAG})")
                else:
                    yield where, row
    except BoundaryError:
        raise
    except Exception as error:  # pyarrow raises several types for unreadable files
        raise BoundaryError(str(path), f"cannot read as Parquet: {type(error).__name__}: {error}") from None


def bounded_size(value: JsonValue, cap: int) -> int:
    """Bytes of text a Parquet row holds (strings and bytes, 8 per other value), counted up to just past `cap`."""
    total, stack = 0, [value]
    while stack and total <= cap:
        item = stack.pop()
        if isinstance(item, str | bytes):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
            total += sum(len(str(key)) for key in item)
        elif isinstance(item, list | tuple):
            stack.extend(item)
        else:
            total += 8
    return total
