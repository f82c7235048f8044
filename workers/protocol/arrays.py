"""Per-token arrays on the control channel: a sample's tokens, loss mask and logprobs as packed little-endian
buffers (msgpack extension types), never one msgpack value per token.

Owns `PackedArray` (one array of one `Kind`: int32 tokens, uint8 masks, float64 logprobs), the extension codes
(`EXT_CODES`) and `from_ext`, the decoder's side. A `PackedArray` either refers to its source (the coordinator's:
a `Sample`'s list, a hook's numpy array or torch tensor — no copy until it is written into a frame) or to its
packed bytes (the rank's: a view of the received frame — no copy until it becomes a tensor).

Invariants:
- Packing keeps today's meaning exactly: an int list is copied by `array` in C, a float list through msgspec's
  msgpack writer (float64: bit-identical to the Python floats; the trainer rounds to float32 itself, as it did
  from the lists); a value `array` refuses (a float standing for an int) takes the per-value `int()` / `float()`
  path.
- A buffer is checked before any value is read: its byte count a multiple of the item size, tokens in 0..2**31-1
  (int32 bounds the top; the sign is checked vectorised), masks 0..255 (uint8 bounds them).
- Packed bytes are little-endian whatever the host (numpy's explicit byte order on both ends).
- Importing this module loads no numpy: each function that needs it imports it, so a process that never packs or
  reads an array (the CLI's `--help`, a dry run, the services) does not pay its ~60 ms and 86 modules.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterator
from enum import Enum
from typing import TYPE_CHECKING, cast

import msgspec

from replay.packed_list import FLOATS_TYPECODE, MASK_TYPECODE, TOKENS_TYPECODE, PackedList

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


class Kind(Enum):
    """(array typecode, numpy dtype, extension code) of one per-token array."""

    TOKENS = (TOKENS_TYPECODE, "<i4", 2)
    MASK = (MASK_TYPECODE, "u1", 3)
    FLOATS = (FLOATS_TYPECODE, "<f8", 4)

    def __init__(self, typecode: str, dtype: str, ext_code: int) -> None:
        # plain attributes, not properties over `value`: a rank reads them a few times per array it decodes
        self.typecode = typecode
        self.dtype_name = dtype
        self.itemsize = int(dtype[-1])  # "<i4", "u1", "<f8": the byte count is the last character
        self.ext_code = ext_code

    @property
    def dtype(self) -> np.dtype[np.generic]:
        """The numpy dtype, built once on first use (this module imports no numpy)."""
        cached = _DTYPES.get(self)
        if cached is None:
            import numpy as np

            cached = _DTYPES[self] = np.dtype(self.dtype_name)
        return cached


#: each kind's numpy dtype, once built (`Kind.dtype`)
_DTYPES: dict[Kind, np.dtype[np.generic]] = {}


#: extension code → kind, for the decoder (the tensor extension is 1, `workers.protocol.codec`)
EXT_CODES = {kind.ext_code: kind for kind in Kind}
_LITTLE = sys.byteorder == "little"
_INT32_MAX = (1 << 31) - 1


class PackedArrayError(ValueError):
    """Values that cannot be one of the channel's per-token arrays (the message names the array and why)."""


class PackedArray:
    """One per-token array. Reads like the list it replaces (`len`, iteration, indexing, `==` against a list or
    another array, `tolist()`); `numpy()` gives the values in the wire dtype without per-value work."""

    __slots__ = ("_kind", "_source", "_view")
    __hash__ = None  # type: ignore[assignment]  # mutable sources, like the lists it stands for

    def __init__(self, kind: Kind, source: object = None, *, view: memoryview | None = None) -> None:
        self._kind = kind
        self._source = source  # the coordinator's list / ndarray / tensor, packed when asked
        self._view = view  # the rank's packed bytes (a view of the frame)

    # ------------------------------------------------------------------------------------------ building

    @classmethod
    def of(cls, kind: Kind, values: object) -> PackedArray:
        """`values` (a list, tuple, numpy array, torch tensor, or a PackedArray of this kind) as one array, by
        reference: the values are read when the array is packed."""
        if isinstance(values, PackedArray):
            if values._kind is not kind:
                raise PackedArrayError(f"a {values._kind.name.lower()} array where {kind.name.lower()} belongs")
            return values
        if isinstance(values, (bytes, bytearray, memoryview, str)):
            raise PackedArrayError(f"expected a sequence of numbers, got {type(values).__name__}")
        return cls(kind, values)

    @classmethod
    def from_ext(cls, code: int, data: memoryview) -> PackedArray:
        """A received extension's array (the view is kept: it refers to the frame, no copy)."""
        kind = EXT_CODES[code]
        size = kind.itemsize
        if len(data) % size:
            raise PackedArrayError(f"a packed {kind.name.lower()} array of {len(data)} bytes is not a whole number "
                                   f"of {size}-byte values")
        packed = cls(kind, view=data)
        if kind is Kind.TOKENS and len(data) and int(packed.numpy().min()) < 0:
            raise PackedArrayError(f"token id {int(packed.numpy().min())} is negative (ids are 0..{_INT32_MAX})")
        return packed

    # ------------------------------------------------------------------------------------------- packing

    @property
    def kind(self) -> Kind:
        return self._kind

    def packed(self) -> memoryview:
        """The little-endian bytes (a view of the frame on the rank; packed from the source on each call on the
        coordinator, where the bytes live only as long as the frame being written needs them)."""
        if self._view is not None:
            return self._view
        return _pack(self._kind, self._source)

    @property
    def sign_checked(self) -> bool:
        """True when the bytes `packed()` gives were packed ahead (`pack_ahead`), which keeps tokens only when
        none is negative: the encoder need not look for a negative id again."""
        source = self._source
        return isinstance(source, PackedList) and source.packed(self._kind.typecode) is not None

    def numpy(self) -> npt.NDArray[np.generic]:
        """The values in the wire dtype (read-only when they are a view of the frame)."""
        import numpy as np

        return np.frombuffer(self.packed(), dtype=self._kind.dtype)

    def tolist(self) -> list[int] | list[float]:
        return cast("list[int] | list[float]", self.numpy().tolist())

    def sum(self) -> int | float:
        """The values' sum, vectorised (an int for tokens and masks)."""
        source = self._source
        if (self._view is None and isinstance(source, list) and self._kind is not Kind.FLOATS
                and not (isinstance(source, PackedList) and source.packed(self._kind.typecode) is not None)):
            total = sum(source)  # a list of ints sums in C without packing it (a packed one sums vectorised)
            if type(total) is int:
                return total
        if self._kind is Kind.FLOATS:
            return float(self.numpy().sum(dtype="float64"))
        values = self.numpy()
        if self._kind is Kind.MASK and (not len(values) or int(values.max()) <= 1):
            import numpy as np

            return int(np.count_nonzero(values))  # a 0/1 mask: its sum, ~10x faster than widening every byte
        return int(values.sum(dtype="int64"))

    # ------------------------------------------------------------------------------------ as a sequence

    def __len__(self) -> int:
        if self._view is not None:
            return len(self._view) // self._kind.itemsize
        return len(self._source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int | float]:
        return iter(self.tolist())

    def __getitem__(self, index: int | slice) -> object:
        return self.tolist()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedArray):  # bit-equal (a NaN equals the same NaN, -0.0 differs from 0.0)
            return self._kind is other._kind and self.packed() == other.packed()
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        values = self.tolist()
        shown = ", ".join(map(str, values[:8])) + (", ..." if len(values) > 8 else "")
        return f"PackedArray({self._kind.name}, [{shown}])"


def as_numpy(kind: Kind, values: object) -> npt.NDArray[np.generic]:
    """`values` (a PackedArray, or a list / array a caller set on a sample after building it) in the wire dtype."""
    return PackedArray.of(kind, values).numpy()


def pack_ahead(kind: Kind, values: object) -> object:
    """`values` as they will be sent, packed now: a list becomes a `PackedList` of the same values holding its
    packed bytes (which `PackedArray.packed` then returns without reading a value); anything else (None, a hook's
    array or tensor) is returned as it is. For a sample's lists while the rollout is still generating
    (`control.pack_sample_ahead`), so the hand-off to the ranks does not read them value by value."""
    if not isinstance(values, list):
        return values
    held = values if isinstance(values, PackedList) else PackedList(values)
    if held.packed(kind.typecode) is None:
        try:
            packed = _pack(kind, held)
        except PackedArrayError:  # left unpacked: the hand-off refuses it with the same error, as before
            return held
        # tokens are kept packed only when none is negative (`sign_checked`); else the hand-off refuses them
        import numpy as np

        if kind is not Kind.TOKENS or not len(packed) or int(np.frombuffer(packed, dtype=kind.dtype).min()) >= 0:
            held.keep_packed(kind.typecode, packed)
    return held


def _pack(kind: Kind, values: object) -> memoryview:
    name = kind.name.lower()
    if isinstance(values, PackedList):
        cached = values.packed(kind.typecode)
        if cached is not None:  # packed when its sample's group was accepted, unchanged since (`PackedList`)
            return cached
    if type(values) is list or type(values) is tuple or isinstance(values, PackedList):
        if kind is Kind.FLOATS:
            packed_floats = _floats_through_msgpack(values)
            if packed_floats is not None:
                return packed_floats
        if kind is Kind.MASK:
            try:  # ints 0..255 (bools too) in C, 3x faster than `array`
                return memoryview(bytes(values))
            except (TypeError, ValueError):
                pass
        try:
            packed = array.array(kind.typecode, values)
        except (TypeError, OverflowError):  # a float standing for an int, a value out of range
            packed = _per_value(kind, values)
        if not _LITTLE:
            packed.byteswap()
        return memoryview(packed).cast("B")
    import numpy as np

    if hasattr(values, "detach"):  # a torch tensor from a hook
        values = values.detach().cpu().numpy()  # type: ignore[attr-defined]
    if not isinstance(values, np.ndarray):
        raise PackedArrayError(f"{name}: expected a list, numpy array or tensor, got {type(values).__name__}")
    if values.ndim != 1:
        raise PackedArrayError(f"{name}: expected one value per token, got an array of shape {values.shape}")
    if kind is not Kind.FLOATS and values.size:
        if values.dtype.kind == "f":  # int() of each value, as the lists' path does
            if not np.isfinite(values).all():
                raise PackedArrayError(f"{name}: a non-finite value cannot be an integer")
            values = np.trunc(values)
        low, high = (0, 255) if kind is Kind.MASK else (-(1 << 31), _INT32_MAX)
        if values.min() < low or values.max() > high:
            raise PackedArrayError(f"{name}: values outside {low}..{high}")
    return memoryview(np.ascontiguousarray(values, dtype=kind.dtype)).cast("B")


#: how msgpack writes a Python float: the tag 0xcb, then the IEEE double big-endian (9 bytes)
_MSGPACK_FLOAT_FIELDS = [("tag", "u1"), ("value", ">f8")]
_MSGPACK_FLOAT_SIZE = 9
_FLOAT_ENCODER = msgspec.msgpack.Encoder()


def _floats_through_msgpack(values: list[object] | tuple[object, ...]) -> memoryview | None:
    """A list of Python floats as little-endian doubles, bit for bit, or None when it holds anything else.

    msgspec writes such a list in C at ~4 ns a value, each float as 9 bytes (0xcb + the double big-endian), so
    the doubles are a strided view of its output: one vectorised check of the tags, one byte-swapping copy —
    ~2.5x faster than `array('d', values)`. An int, a bool, a numpy scalar is not 0xcb + 8 bytes (or not
    encodable): None, and `array` takes the list."""
    try:
        encoded = _FLOAT_ENCODER.encode(values)
    except (TypeError, msgspec.EncodeError):
        return None
    count = len(values)
    header = 1 if count < 16 else 3 if count < 1 << 16 else 5  # fixarray, array 16, array 32
    if len(encoded) != header + _MSGPACK_FLOAT_SIZE * count:
        return None
    import numpy as np

    records = np.frombuffer(encoded, dtype=np.dtype(_MSGPACK_FLOAT_FIELDS), offset=header)
    if not (records["tag"] == 0xCB).all():
        return None
    return memoryview(records["value"].astype("<f8")).cast("B")


def _per_value(kind: Kind, values: list[object] | tuple[object, ...]) -> array.array[int] | array.array[float]:
    convert = float if kind is Kind.FLOATS else int
    try:
        return array.array(kind.typecode, [convert(value) for value in values])  # type: ignore[arg-type]
    except OverflowError:
        low, high = (0, 255) if kind is Kind.MASK else (-(1 << 31), _INT32_MAX)
        raise PackedArrayError(f"{kind.name.lower()}: values outside {low}..{high}") from None
    except (TypeError, ValueError) as exc:
        raise PackedArrayError(f"{kind.name.lower()}: {exc}") from None
