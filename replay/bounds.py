"""What decoding untrusted dump data may cost: nesting depth and memory, checked before anything is built.

Owns the two bounds every reader of dump data applies: `check_msgpack(payload)` (one record walked byte by
byte without building it: depth, known extension types, estimated expansion) and `measure_plain(obj, budget)`
(an unpickled graph's plain expansion, shared objects counted per reference, each object visited once). Why
(msgpack's C stack, reference bombs): docs/replay.md.

Invariant: both raise `BoundError` (a ValueError) and nothing else for any input; they never recurse more
than `MAX_DEPTH` Python frames; estimates are upper bounds of CPython 3.11's 64-bit object sizes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

#: containers (maps, arrays, tuples) nested in one record; the sample record itself is level 1
MAX_DEPTH = 32
#: decoded Python bytes allowed per encoded byte (token arrays take ~11x, strings ~4x, an empty list 64x)
MAX_EXPANSION = 16
#: fixed decoded bytes allowed per record on top (the record's own keys and small values)
RECORD_ALLOWANCE = 64 * 1024

# msgpack extension codes of the rayless dump format (replay.format keeps the same numbers)
EXT_TUPLE = 1
#: packed little-endian arrays: code -> (item size, decoded bytes per item: list slot + the number object)
PACKED_ARRAYS: dict[int, tuple[int, int]] = {10: (1, 8 + 32), 11: (4, 8 + 32), 12: (8, 8 + 32), 13: (8, 8 + 24)}

# CPython object sizes (rounded up): the container's own object and, per item, its slot(s)
_LIST, _LIST_ITEM = 64, 8
_TUPLE, _TUPLE_ITEM = 48, 8
_DICT, _DICT_ITEM = 240, 48  # a dict's table grows in steps; 48 covers entry + index + growth slack
_STR, _STR_CHAR = 80, 4  # UCS-4 at worst
_BYTES = 40
_INT = 32
_FLOAT = 24
_ARRAY = 80  # array.array header


class BoundError(ValueError):
    """Data that would nest too deep, expand too far or reference itself; the message says which bound."""


class _OverLimit(Exception):
    def __init__(self, cost: int) -> None:
        super().__init__(cost)
        self.cost = cost


def _bound_for(size: int) -> int:
    return MAX_EXPANSION * size + RECORD_ALLOWANCE


# ------------------------------------------------------------------------------------- msgpack records

_U8, _U16, _U32 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I")


class _Scanner:
    """One pass over a msgpack buffer: depth, extension codes and the decoded-size estimate."""

    def __init__(self, data: bytes | memoryview, allowed_ext: frozenset[int], limit: int) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.cost = 0
        self.allowed_ext = allowed_ext
        self.limit = limit  # the scan stops as soon as the estimate passes it: the work stays bounded too
        self.top_items = 0  # items of the outermost container (a tuple's slots)

    def _take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise BoundError(f"msgpack data ends inside a value (needs {n} bytes at offset {self.pos})")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def _length(self, fmt: struct.Struct) -> int:
        return int(fmt.unpack(self._take(fmt.size))[0])

    def scan(self, depth: int) -> None:
        """Scan one value at nesting `depth` (containers open so far), and whatever it contains."""
        # An explicit stack of items still to read in each open container: no recursion per container.
        pending = [1]
        base = depth
        while pending:
            if pending[-1] == 0:
                pending.pop()
                continue
            pending[-1] -= 1
            count = self._value(base + len(pending) - 1)
            if self.cost > self.limit:
                raise _OverLimit(self.cost)
            if count is not None:
                pending.append(count)

    def _open(self, depth: int, items: int, container: int, per_item: int) -> int:
        if depth + 1 > MAX_DEPTH:
            raise BoundError(f"containers nest deeper than {MAX_DEPTH} levels")
        if items > len(self.data) - self.pos:  # every value takes at least one byte
            raise BoundError(f"a container declares {items} values with {len(self.data) - self.pos} bytes left")
        if self.cost == 0:  # the first container opened is the outermost one
            self.top_items = items
        self.cost += container + per_item * items
        return items

    def _value(self, depth: int) -> int | None:
        """Read one value's head; returns the number of child values to read for a map or an array."""
        (byte,) = self._take(1)
        if byte <= 0x7F or byte >= 0xE0 or byte in (0xC0, 0xC2, 0xC3):
            return None  # fixint, nil, bool: shared objects, their slot is counted by the container
        if 0x80 <= byte <= 0x8F:
            return self._map(depth, byte & 0x0F)
        if 0x90 <= byte <= 0x9F:
            return self._array(depth, byte & 0x0F)
        if 0xA0 <= byte <= 0xBF:
            return self._str(byte & 0x1F)
        head = _HEADS.get(byte)
        if head is None:
            raise BoundError(f"byte 0x{byte:02x} at offset {self.pos - 1} starts no msgpack value")
        return head(self, depth)

    def _str(self, length: int) -> None:
        self._take(length)
        if length > 1:  # CPython shares the empty string and every one-character latin-1 string
            self.cost += _STR + _STR_CHAR * length

    def _bin(self, length: int) -> None:
        self._take(length)
        self.cost += _BYTES + length

    def _number(self, size: int, cost: int) -> None:
        self._take(size)
        self.cost += cost

    def _array(self, depth: int, items: int) -> int | None:
        return self._open(depth, items, _LIST, _LIST_ITEM) or None

    def _map(self, depth: int, items: int) -> int | None:
        # n pairs: 2n values to read, an entry's cost split over its key and value
        return self._open(depth, 2 * items, _DICT, _DICT_ITEM // 2) or None

    def _ext(self, length: int, depth: int) -> None:
        (code,) = self._take(1)
        code = code - 256 if code > 127 else code
        data = self._take(length)
        if code not in self.allowed_ext:
            raise BoundError(f"unknown msgpack extension type {code} (known: {sorted(self.allowed_ext)})")
        if code == EXT_TUPLE:
            if not data or not (0x90 <= data[0] <= 0x9F or data[0] in (0xDC, 0xDD)):
                raise BoundError("a tuple extension must hold an array")
            # The tuple's payload is one msgpack array of its own, the tuple's level: scan it there. Depth is
            # bounded, so this recursion is too.
            inner = _Scanner(data, self.allowed_ext, self.limit - self.cost)
            inner.scan(depth)
            if inner.pos != len(data):
                raise BoundError(f"a tuple extension holds {len(data) - inner.pos} bytes after its array")
            # the tuple is built from the decoded list, both alive for a moment
            self.cost += inner.cost + _TUPLE + _TUPLE_ITEM * inner.top_items
            return
        packed = PACKED_ARRAYS.get(code)
        if packed is not None:
            itemsize, per_item = packed
            if length % itemsize:
                raise BoundError(f"a packed array of {length} bytes is not a whole number of {itemsize}-byte items")
            # the array.array and the list it becomes (both alive while the record is converted)
            self.cost += _ARRAY + length + _LIST + per_item * (length // itemsize)
            return
        self.cost += _BYTES + length  # an extension msgpack hands over as ExtType(code, bytes)


def _fixed(size: int, cost: int) -> Callable[[_Scanner, int], None]:
    return lambda scanner, depth: scanner._number(size, cost)


def _sized(length: struct.Struct, reader: str) -> Callable[[_Scanner, int], Any]:
    def head(scanner: _Scanner, depth: int) -> Any:
        n = scanner._length(length)
        if reader in ("array", "map"):
            return getattr(scanner, "_" + reader)(depth, n)
        if reader == "ext":
            return scanner._ext(n, depth)
        return getattr(scanner, "_" + reader)(n)

    return head


def _fixext(size: int) -> Callable[[_Scanner, int], None]:
    return lambda scanner, depth: scanner._ext(size, depth)


_HEADS: dict[int, Callable[[_Scanner, int], Any]] = {
    0xC4: _sized(_U8, "bin"), 0xC5: _sized(_U16, "bin"), 0xC6: _sized(_U32, "bin"),
    0xC7: _sized(_U8, "ext"), 0xC8: _sized(_U16, "ext"), 0xC9: _sized(_U32, "ext"),
    0xCA: _fixed(4, _FLOAT), 0xCB: _fixed(8, _FLOAT),
    0xCC: _fixed(1, 0), 0xCD: _fixed(2, _INT), 0xCE: _fixed(4, _INT), 0xCF: _fixed(8, _INT),
    0xD0: _fixed(1, _INT), 0xD1: _fixed(2, _INT), 0xD2: _fixed(4, _INT), 0xD3: _fixed(8, _INT),
    0xD4: _fixext(1), 0xD5: _fixext(2), 0xD6: _fixext(4), 0xD7: _fixext(8), 0xD8: _fixext(16),
    0xD9: _sized(_U8, "str"), 0xDA: _sized(_U16, "str"), 0xDB: _sized(_U32, "str"),
    0xDC: _sized(_U16, "array"), 0xDD: _sized(_U32, "array"),
    0xDE: _sized(_U16, "map"), 0xDF: _sized(_U32, "map"),
}  # fmt: skip


def check_msgpack(payload: bytes | memoryview, *, allowed_ext: frozenset[int]) -> int:
    """Check one msgpack record before it is decoded; returns its estimated decoded size in bytes.

    Raises BoundError when it is not exactly one msgpack value, nests containers deeper than `MAX_DEPTH`,
    uses an extension code outside `allowed_ext`, or would decode to more than
    `MAX_EXPANSION * len(payload) + RECORD_ALLOWANCE` bytes of Python objects.
    """
    limit = _bound_for(len(payload))
    scanner = _Scanner(payload, allowed_ext, limit)
    try:
        scanner.scan(0)
    except _OverLimit as over:
        raise BoundError(
            f"the record would decode to more than {over.cost} bytes of Python objects, over the bound of "
            f"{limit} ({MAX_EXPANSION}x its {len(payload)} bytes + {RECORD_ALLOWANCE}): it holds mostly empty "
            "or tiny containers, which no dump writer produces"
        ) from None
    if scanner.pos != len(scanner.data):
        raise BoundError(f"{len(scanner.data) - scanner.pos} bytes follow the record's msgpack value")
    return scanner.cost


# ------------------------------------------------------------------------------ unpickled object graphs

#: decoded bytes per tensor element by dtype item size once converted to a Python list (slot + number)
_TENSOR_ITEM = 8 + 32


def measure_plain(obj: Any, budget: int, *, max_depth: int = MAX_DEPTH) -> int:
    """Bytes that converting `obj` to plain, unshared lists/dicts would take; BoundError past `budget`.

    Counts an object once per reference to it (the conversion copies shared objects), visits each distinct
    object once, refuses an object that contains itself and nesting deeper than `max_depth`.
    """
    # Every object measured is reachable from `obj`, which the caller holds: ids stay unique for the walk.
    memo: dict[int, int] = {}

    def size(value: Any, depth: int, path: set[int]) -> int:
        if value is None or type(value) is bool or (type(value) is int and -5 <= value <= 256):
            return _LIST_ITEM  # shared objects: only the slot that refers to them
        if type(value) in (int, float):
            return _LIST_ITEM + _INT
        if type(value) is str:
            return _LIST_ITEM + _STR + _STR_CHAR * len(value)
        if type(value) in (bytes, bytearray):
            return _LIST_ITEM + _BYTES + len(value)
        key = id(value)
        known = memo.get(key)
        if known is not None:
            return known
        if key in path:
            raise BoundError("the data contains itself (a container that references itself)")
        if depth >= max_depth:
            raise BoundError(f"containers nest deeper than {max_depth} levels")
        numel = getattr(value, "numel", None)
        if callable(numel) and type(value).__module__.startswith("torch"):
            total = _LIST_ITEM + _LIST + _TENSOR_ITEM * int(numel())
        elif isinstance(value, dict):
            path.add(key)
            # key and value count their own slots; the entry's remaining bytes are counted here
            total = _LIST_ITEM + _DICT + (_DICT_ITEM - 2 * _LIST_ITEM) * len(value)
            for k, v in value.items():
                total += size(k, depth + 1, path) + size(v, depth + 1, path)
                _check(total)
            path.discard(key)
        elif isinstance(value, list | tuple | set | frozenset):
            path.add(key)
            total = _LIST + _LIST_ITEM
            for item in value:
                total += size(item, depth + 1, path)
                _check(total)
            path.discard(key)
        else:
            total = _LIST_ITEM + _BYTES  # not plain data: the conversion refuses it by name
        memo[key] = total
        _check(total)
        return total

    def _check(total: int) -> None:
        if total > budget:
            raise BoundError(
                f"the data would expand to more than {budget} bytes of Python objects (shared references are "
                "copied once per use): a reference bomb or a dump far larger than its file"
            )

    return size(obj, 0, set())
