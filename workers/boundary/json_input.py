"""Bounded JSON decoding: size, nesting depth and element count checked, off the event loop when large.

Invariant: `decode_json` either returns plain JSON values (dict, list, str, int, float, bool, None) within
`JsonLimits`, or raises `BoundaryError`; never RecursionError, never NaN or Infinity (not JSON), and the
element count is bounded before anything is built, so a body of `[[],[],...]` cannot take a gigabyte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeAlias

import anyio
import msgspec

from workers.boundary.errors import BoundaryError

#: a value of a JSON document as `decode_json` returns it (what a JSON object's fields, an HTTP body, a label hold)
JsonValue: TypeAlias = bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"] | None
#: a JSON object: a request or reply body, a message, a tool call
JsonObject: TypeAlias = dict[str, JsonValue]

PARSE_IN_THREAD_BYTES = 1 << 20  # above this, decoding takes long enough (>~5 ms) to move off the loop
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


@dataclass(frozen=True)
class JsonLimits:
    """What one document may hold. Defaults fit SGLang-shaped requests and replies of 128k-token samples."""

    max_bytes: int = 64 << 20
    max_depth: int = 64
    max_items: int = 2_000_000  # values of any kind, containers included (2M empty lists: ~110 MiB)

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_depth, self.max_items) < 1:
            raise ValueError(f"JSON limits must be positive, not {self}")


DEFAULT_LIMITS = JsonLimits()


def _items_upper_bound(data: bytes) -> int:
    # Every value but the first is preceded by a ',' or a '[' / ':' opening its place; counting those bytes
    # bounds the element count from above without building anything (C speed).
    return data.count(b",") + data.count(b"[") + data.count(b":") + 1


def _count_items(data: bytes) -> int:
    """Items outside strings; only when the cheap bound is over the limit (strings may hold ',' and '[')."""
    return _items_upper_bound(_STRING.sub(b'""', data))


def check_depth(value: Any, source: str, max_depth: int, *, level: int = 1) -> None:
    """`value`, found at nesting `level` of its document, takes it at most `max_depth` deep, or `BoundaryError`."""
    stack: list[tuple[Any, int]] = [(value, level)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise BoundaryError(source, f"JSON nested deeper than {max_depth} levels")
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (list, dict)):
                stack.append((child, depth + 1))


# translate's delete tables: everything but the brackets; everything but the brackets, quotes and backslashes
_BRACKETS_ONLY = bytes(range(256)).translate(None, b"[]{}")
_BRACKETS_AND_QUOTES = bytes(range(256)).translate(None, b'[]{}"\\')


def check_depth_of_bytes(raw: bytes, source: str, max_depth: int) -> None:
    """The depth rule of `check_depth`, read from a document's bytes without decoding them (for a reader that
    decoded only the fields it needs, e.g. into a msgspec schema that skips the rest). `raw` must be valid
    JSON. Strings are cut out first (they may hold brackets): when no quote is escaped, every quote delimits
    a string, so the pieces between an even and the next odd quote are outside strings; else by the string
    pattern. Then each pass deletes the empty `[]` / `{}` pairs, exactly one level a pass (a pair is marked
    before any is deleted, so a pair this pass empties waits for the next). All of it runs at C speed: about a
    third of a plain decode of a reply with logprobs."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:  # depth is at most the number of openings
        return
    if b'\\"' in raw:
        brackets = _STRING.sub(b"", raw).translate(None, _BRACKETS_ONLY)
    else:  # outside strings valid JSON holds no backslash: the even pieces are brackets only
        kept = raw.translate(None, _BRACKETS_AND_QUOTES)
        # Most strings keep nothing but their quotes: drop those pairs in one pass. A string that keeps a bracket
        # or backslash leaves an odd run of quotes (its opening one), so any quote left means the split is needed.
        brackets = kept.replace(b'""', b"")
        if b'"' in brackets:
            brackets = b"".join(kept.split(b'"')[0::2])
    for _ in range(max_depth):
        if not brackets:
            return
        brackets = brackets.replace(b"[]", b"\0").replace(b"{}", b"\1").replace(b"\0", b"").replace(b"\1", b"")
    if brackets:
        raise BoundaryError(source, f"JSON nested deeper than {max_depth} levels")


def check_bounds(raw: bytes, source: str, limits: JsonLimits) -> None:
    """The checks made before decoding: size, and the element count (bounded from the bytes, C speed)."""
    if len(raw) > limits.max_bytes:
        raise BoundaryError(source, f"JSON of {len(raw)} bytes is over the limit of {limits.max_bytes}")
    if _items_upper_bound(raw) > limits.max_items and _count_items(raw) > limits.max_items:
        raise BoundaryError(source, f"JSON holds more than {limits.max_items} values")


def decode_json(data: bytes | str, source: str, limits: JsonLimits = DEFAULT_LIMITS) -> Any:
    """One JSON document from `source` (a peer or a file, named in the error), within `limits`."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    check_bounds(raw, source, limits)
    try:
        value = msgspec.json.decode(raw)
    except RecursionError:  # msgspec's own guard, raised before the C stack is at risk
        raise BoundaryError(source, f"JSON nested deeper than {limits.max_depth} levels") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BoundaryError(source, f"not valid JSON ({_short(str(exc))})") from None
    # Depth is at most the number of '[' and '{' bytes: most documents are shallower than the limit by count.
    if isinstance(value, (list, dict)) and raw.count(b"[") + raw.count(b"{") > limits.max_depth:
        check_depth(value, source, limits.max_depth)
    return value


async def decode_json_async(data: bytes | str, source: str, limits: JsonLimits = DEFAULT_LIMITS) -> Any:
    """`decode_json`, in a worker thread when the document is large enough to stall the event loop."""
    if len(data) > PARSE_IN_THREAD_BYTES:
        return await anyio.to_thread.run_sync(decode_json, data, source, limits)
    return decode_json(data, source, limits)


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
