"""A list that can carry its own packed bytes: a `Sample`'s per-token list (tokens, loss mask, logprobs) packed
once, when its group is accepted during the rollout, or read from a dump with its bytes (`from_packed_array`), so
the hand-off to the ranks reads no Python value again.

Owns `PackedList`: a `list` in every way a hook sees (slime's custom generate / reward / filter hooks read and
mutate `sample.tokens`, `loss_mask`, `rollout_log_probs` as lists), plus one cached packing, `(typecode, bytes)`,
that the control channel's packer (`workers.protocol.arrays`) stores and reuses.

Invariant: the cached bytes are exactly what packing the current values gives, or there are none. Every list
method that changes the values in place drops them first (`__setitem__` / `__delitem__` with an index or a slice,
`+=`, `*=`, `append`, `extend`, `insert`, `pop`, `remove`, `clear`, `sort`, `reverse`, and `__init__` called
again); anything that builds a new list (`+`, slicing, `[*a, *b]`, `copy`, `copy.deepcopy`, pickling) gives a plain
list without them. Only code that calls `list`'s own methods on it explicitly (`list.append(x, v)`) or the C
API (`heapq`'s C functions) bypasses these methods; nothing in a sample's life does either.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import SupportsIndex

#: the control channel's typecodes for a sample's per-token lists: int32 token ids, uint8 loss-mask entries,
#: float64 logprobs (`workers.protocol.arrays.Kind` is built from these, so the two cannot drift apart)
TOKENS_TYPECODE, MASK_TYPECODE, FLOATS_TYPECODE = "i", "B", "d"
_LITTLE = sys.byteorder == "little"


class PackedList(list):  # type: ignore[type-arg]  # holds whatever the list it replaces held
    """A list plus its packed bytes under one typecode (None: not packed, or changed since)."""

    __slots__ = ("_packed",)

    def __init__(self, values: Iterable[object] = ()) -> None:
        self._packed: tuple[str, memoryview] | None = None
        super().__init__(values)

    def packed(self, typecode: str) -> memoryview | None:
        """The bytes packed under `typecode` for the current values, or None."""
        cached = self._packed
        return cached[1] if cached is not None and cached[0] == typecode else None

    def keep_packed(self, typecode: str, data: memoryview) -> None:
        """Remember `data` as the values packed under `typecode` (the caller packed exactly these values)."""
        self._packed = (typecode, data)

    # Every in-place change drops the packed bytes before it happens (an exception half-way leaves none).

    def __setitem__(self, index: SupportsIndex | slice, value: object) -> None:  # type: ignore[override]
        self._packed = None
        super().__setitem__(index, value)  # type: ignore[index]

    def __delitem__(self, index: SupportsIndex | slice) -> None:
        self._packed = None
        super().__delitem__(index)

    def __iadd__(self, values: Iterable[object]) -> PackedList:  # type: ignore[override,misc]
        self._packed = None
        return super().__iadd__(values)  # type: ignore[return-value]

    def __imul__(self, count: SupportsIndex) -> PackedList:  # type: ignore[override]
        self._packed = None
        return super().__imul__(count)  # type: ignore[return-value]

    def append(self, value: object) -> None:
        self._packed = None
        super().append(value)

    def extend(self, values: Iterable[object]) -> None:
        self._packed = None
        super().extend(values)

    def insert(self, index: SupportsIndex, value: object) -> None:
        self._packed = None
        super().insert(index, value)

    def pop(self, index: SupportsIndex = -1) -> object:
        self._packed = None
        return super().pop(index)

    def remove(self, value: object) -> None:
        self._packed = None
        super().remove(value)

    def clear(self) -> None:
        self._packed = None
        super().clear()

    def sort(self, *args: object, **kwargs: object) -> None:
        self._packed = None
        super().sort(*args, **kwargs)  # type: ignore[call-overload]

    def reverse(self) -> None:
        self._packed = None
        super().reverse()

    def copy(self) -> list:  # type: ignore[type-arg]
        return list(self)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[type[list], tuple[list]]:  # type: ignore[type-arg,override]
        # copy, deepcopy and pickle give a plain list of the values: packed bytes never travel with a copy
        return list, (list(self),)


def from_packed_array(values: array) -> PackedList:  # type: ignore[type-arg]
    """A dump's packed array (`replay.format`) as a `PackedList` of its values that keeps the array's bytes
    where they are exactly what the control channel packs: int32 ids with none negative (the channel keeps
    tokens packed only then), int8 entries with none negative (the bytes of their uint8 packing), float64s. So a
    replayed sample reaches the ranks as a generated one packed ahead does, without one value read again. On a
    big-endian host, or for any other array (int64 values, a negative entry), no bytes are kept: the hand-off
    packs the list as it packs any list."""
    held = PackedList(values)  # built from the array itself: no intermediate list
    if not _LITTLE or not len(values):
        return held
    data = memoryview(values).cast("B")
    typecode = values.typecode
    if typecode == FLOATS_TYPECODE:
        held.keep_packed(FLOATS_TYPECODE, data)
    elif typecode == TOKENS_TYPECODE:
        import numpy  # here, not at the top: only a read of a dump's tokens needs it

        if int(numpy.frombuffer(data, dtype="<i4").min()) >= 0:
            held.keep_packed(TOKENS_TYPECODE, data)
    elif typecode == "b" and bytes(data).isascii():  # int8 values 0..127: bytes equal to their uint8 packing
        held.keep_packed(MASK_TYPECODE, data)
    return held
