"""A sample's lists packed ahead (`replay.packed_list.PackedList`, `workers.protocol.pack_sample_ahead`): the
frames are the bytes the plain lists give, and any in-place change by a hook drops the packed bytes; a frame
sent as parts (`encode_frame_parts`) is the same bytes."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable

import msgspec
import pytest

from replay.format import write_dump
from replay.packed_list import PackedList
from replay.reader import read_dump
from replay.sample import Sample, SampleStatus
from workers import protocol
from workers.protocol.arrays import Kind, PackedArray, PackedArrayError, pack_ahead
from workers.protocol.control import PACK_AHEAD_MIN_TOKENS
from workers.protocol.scatter import PART_MIN_BYTES


def sample(response: int = 600, *, prompt: int = 3, distilled: bool = False) -> Sample:
    return Sample(group_index=1, sample_index=2, tokens=[10 + i for i in range(prompt + response)],
                  response_length=response, loss_mask=[1, 0] * (response // 2) + [1] * (response % 2),
                  rollout_log_probs=[-0.5 - i / 7 for i in range(response)], status=SampleStatus.COMPLETED,
                  advantage=0.25, teacher_log_probs=[-1.0 / (i + 1) for i in range(response)] if distilled else None,
                  reward=1.0)


def frame_of(*samples: Sample) -> bytes:
    wire = [protocol.WireSample.from_sample(s) for s in samples]
    return bytes(protocol.encode_frame(protocol.Request(1, protocol.TrainCommand(0, [wire], [3]))))


def packed_copy(original: Sample) -> Sample:
    ahead = copy.deepcopy(original)
    protocol.pack_sample_ahead(ahead)
    return ahead


@pytest.mark.parametrize("distilled", [False, True])
def test_packed_ahead_the_frame_is_the_plain_lists_bytes(distilled: bool) -> None:
    plain = sample(distilled=distilled)
    ahead = packed_copy(plain)
    for name, kind in (("tokens", Kind.TOKENS), ("loss_mask", Kind.MASK), ("rollout_log_probs", Kind.FLOATS)):
        values = getattr(ahead, name)
        assert type(values) is PackedList and values == getattr(plain, name)
        assert values.packed(kind.typecode) is not None
    assert (ahead.teacher_log_probs is None) is not distilled
    assert frame_of(ahead) == frame_of(plain)


def test_a_short_sample_is_left_as_it_is() -> None:
    short = sample(response=4)
    assert len(short.tokens) < PACK_AHEAD_MIN_TOKENS
    protocol.pack_sample_ahead(short)
    assert type(short.tokens) is list and type(short.loss_mask) is list and type(short.rollout_log_probs) is list


def test_the_hand_off_reads_the_packed_bytes_not_the_values() -> None:
    ahead = packed_copy(sample())
    marked = memoryview(bytes(len(ahead.tokens) * 4))  # zeros: what the hand-off sends must be this
    ahead.tokens.keep_packed("i", marked)
    wire = protocol.WireSample.from_sample(ahead)
    assert wire.tokens.packed() is marked
    assert wire.tokens.tolist() == [0] * len(ahead.tokens)


#: every in-place change a list offers (a hook may do any of them to `sample.tokens` / `loss_mask` / logprobs)
MUTATIONS: dict[str, Callable[[list[object]], object]] = {
    "setitem": lambda v: v.__setitem__(0, 1),
    "setitem negative": lambda v: v.__setitem__(-1, 0),
    "slice assignment": lambda v: v.__setitem__(slice(1, 3), [0, 0]),
    "slice assignment that grows": lambda v: v.__setitem__(slice(0, 0), [1]),
    "delitem": lambda v: v.__delitem__(0),
    "del slice": lambda v: v.__delitem__(slice(0, 2)),
    "+=": lambda v: v.__iadd__([1]),
    "*=": lambda v: v.__imul__(2),
    "append": lambda v: v.append(1),
    "extend": lambda v: v.extend([0, 1]),
    "insert": lambda v: v.insert(1, 0),
    "pop": lambda v: v.pop(),
    "pop index": lambda v: v.pop(0),
    "remove": lambda v: v.remove(v[1]),
    "clear": lambda v: v.clear(),
    "sort": lambda v: v.sort(),
    "sort reversed": lambda v: v.sort(reverse=True),
    "reverse": lambda v: v.reverse(),
    "__init__ again": lambda v: v.__init__([1, 0, 1]),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
@pytest.mark.parametrize(("field", "kind"), [("tokens", Kind.TOKENS), ("loss_mask", Kind.MASK),
                                             ("rollout_log_probs", Kind.FLOATS)])
def test_any_in_place_change_drops_the_packed_bytes(name: str, field: str, kind: Kind) -> None:
    values = pack_ahead(kind, [1, 0, 1, 1, 0] if kind is not Kind.FLOATS else [-0.5, -1.5, -0.25, -2.0, -3.0])
    assert isinstance(values, PackedList) and values.packed(kind.typecode) is not None
    MUTATIONS[name](values)
    assert values.packed(kind.typecode) is None
    # and what is sent is the changed values, as a plain list of them sends them
    assert PackedArray.of(kind, values).packed() == PackedArray.of(kind, list(values)).packed()


def test_every_mutating_list_method_is_overridden() -> None:
    # list's methods that read only (or build a new list); any other method of list must drop the bytes, so a
    # Python that adds a mutator fails here until PackedList overrides it
    reading = {"__add__", "__class__", "__class_getitem__", "__contains__", "__delattr__", "__dir__", "__doc__",
               "__eq__", "__format__", "__ge__", "__getattribute__", "__getitem__", "__getstate__", "__gt__",
               "__hash__", "__init_subclass__", "__iter__", "__le__", "__len__", "__lt__", "__mul__", "__ne__",
               "__new__", "__reduce__", "__repr__", "__reversed__", "__rmul__", "__setattr__", "__sizeof__",
               "__str__", "__subclasshook__", "count", "index"}
    mutators = set(dir(list)) - reading - {"__reduce_ex__", "copy"}
    assert mutators - set(vars(PackedList)) == set()
    assert mutators >= {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__",
                        "__delitem__", "__iadd__", "__imul__", "__init__"}


def test_reading_keeps_the_bytes_and_new_lists_are_plain() -> None:
    values = pack_ahead(Kind.TOKENS, [5, 6, 7])
    assert isinstance(values, PackedList)
    assert (len(values), values[1], values[-2:], list(values), 6 in values, values.index(7)) == (
        3, 6, [6, 7], [5, 6, 7], True, 2)
    assert values.packed("i") is not None
    for made in (values.__add__([8]), values[:], [*values], values * 2, values.copy(), copy.copy(values),
                 copy.deepcopy(values), values.__reduce_ex__(2)[0](*values.__reduce_ex__(2)[1])):
        assert type(made) is list
    assert values.packed("d") is None  # bytes are kept under one typecode only


def test_a_hooks_change_after_packing_is_what_the_ranks_get() -> None:
    plain, ahead = sample(), packed_copy(sample())
    for s in (plain, ahead):
        s.tokens[4] = 99
        s.loss_mask[0] = 0
        s.rollout_log_probs.sort()
    assert frame_of(ahead) == frame_of(plain)
    for s in (plain, ahead):  # a new list from a hook
        s.tokens = [*s.tokens[:-1], 7]
    assert frame_of(ahead) == frame_of(plain)


def test_values_packing_refuses_are_left_for_the_hand_off_to_refuse() -> None:
    bad = sample()
    bad.loss_mask[0] = 300
    protocol.pack_sample_ahead(bad)  # no error during the rollout
    assert isinstance(bad.loss_mask, PackedList) and bad.loss_mask.packed("B") is None
    with pytest.raises(Exception, match="mask"):
        frame_of(bad)
    with pytest.raises(PackedArrayError):
        PackedArray.of(Kind.MASK, [300]).packed()


def test_a_packed_sample_validates_encodes_and_dumps_as_lists(tmp_path: object) -> None:
    plain, ahead = sample(distilled=True), packed_copy(sample(distilled=True))
    ahead.validate()
    assert msgspec.json.encode(ahead.tokens) == msgspec.json.encode(plain.tokens)
    assert json.dumps(ahead.rollout_log_probs) == json.dumps(plain.rollout_log_probs)
    path = write_dump(tmp_path / "0.rld", 0, [ahead, plain], config_facts={})  # type: ignore[operator]
    loaded = read_dump(path).samples
    for name in ("tokens", "loss_mask", "rollout_log_probs", "teacher_log_probs"):
        assert list(getattr(loaded[0], name)) == list(getattr(loaded[1], name)) == list(getattr(plain, name))
    assert frame_of(loaded[0]) == frame_of(plain)


@pytest.mark.parametrize("response", [0, 1, 100, 255, 256, 600, 16_383, 16_384, 70_000])
def test_a_frames_parts_joined_are_the_frame(response: int) -> None:
    # arrays of every msgpack extension size (fixext, ext 8 / 16 / 32), over and under PART_MIN_BYTES, some
    # packed ahead and some plain
    plain = sample(response=response, distilled=True)
    ahead = packed_copy(plain)
    wire = [protocol.WireSample.from_sample(s) for s in (plain, ahead, sample(response=3))]
    message = protocol.Request(7, protocol.TrainCommand(0, [wire, wire[:1]], [3, 1]))
    parts = protocol.encode_frame_parts(message)
    assert b"".join(bytes(part) for part in parts) == bytes(protocol.encode_frame(message))
    if response >= PART_MIN_BYTES:  # the packed-ahead sample's bytes are sent from where they lie
        assert any(isinstance(part, memoryview) and part.obj is ahead.tokens.packed("i").obj for part in parts)


def test_a_frame_of_parts_over_the_limit_is_refused_before_anything_is_sent() -> None:
    message = protocol.Request(1, protocol.TrainCommand(0, [[protocol.WireSample.from_sample(sample())]], [1]))
    size = len(protocol.encode_frame(message)) - 4
    assert protocol.encode_frame_parts(message, size)  # exactly at the limit
    with pytest.raises(protocol.FrameTooLarge, match=f"exceeds the control-channel limit of {size - 1} bytes"):
        protocol.encode_frame_parts(message, size - 1)
    bad = protocol.WireSample.from_sample(sample())
    bad.tokens = PackedArray.of(Kind.TOKENS, [-1] * len(bad.tokens))
    with pytest.raises(protocol.ProtocolError, match="negative"):
        protocol.encode_frame_parts(protocol.Request(1, protocol.TrainCommand(0, [[bad]], [1])))


def test_negative_tokens_are_not_kept_packed_and_the_hand_off_refuses_them() -> None:
    """The encoder skips the sign check only for tokens packed ahead, which keeps none that is negative."""
    bad = sample()
    bad.tokens[5] = -4
    protocol.pack_sample_ahead(bad)
    assert bad.tokens.packed("i") is None and bad.loss_mask.packed("B") is not None
    with pytest.raises(protocol.ProtocolError, match="token id -4 is negative"):
        frame_of(bad)
    good = packed_copy(sample())
    assert protocol.WireSample.from_sample(good).tokens.sign_checked
    assert not protocol.WireSample.from_sample(sample()).tokens.sign_checked
    good.tokens[0] = -1  # changed after packing: the bytes are dropped, the check runs again
    with pytest.raises(protocol.ProtocolError, match="token id -1 is negative"):
        frame_of(good)


@pytest.mark.parametrize("mask", [[], [0], [1], [0, 1, 1, 0, 1], [1] * 700, [0, 2, 1, 255, 0], [3] * 5])
def test_a_mask_sums_to_its_values_however_it_is_held(mask: list[int]) -> None:
    """`plan_steps` sums each sample's loss mask: a 0/1 mask is counted, a mask with larger values summed."""
    received = PackedArray.from_ext(Kind.MASK.ext_code, memoryview(bytes(mask)))
    for held in (PackedArray.of(Kind.MASK, list(mask)), PackedArray.of(Kind.MASK, pack_ahead(Kind.MASK, list(mask))),
                 received):
        total = held.sum()
        assert type(total) is int and total == sum(mask)


CHANNEL_FIELDS = (("tokens", Kind.TOKENS), ("loss_mask", Kind.MASK), ("rollout_log_probs", Kind.FLOATS),
                  ("teacher_log_probs", Kind.FLOATS))


def test_a_replayed_sample_reaches_the_ranks_from_the_dumps_bytes(tmp_path: object) -> None:
    """A dump's packed arrays are the channel's bytes: read back, each list keeps them, as a generated sample
    packed ahead does, and the hand-off sends them without reading a value (the frame is the plain lists')."""
    plain = sample(distilled=True)
    path = write_dump(tmp_path / "0.rld", 0, [plain], config_facts={})  # type: ignore[operator]
    replayed = read_dump(path).samples[0]
    wire = protocol.WireSample.from_sample(replayed)
    for name, kind in CHANNEL_FIELDS:
        values = getattr(replayed, name)
        assert type(values) is PackedList and values == getattr(plain, name)
        kept = values.packed(kind.typecode)
        assert kept is not None and bytes(kept) == bytes(PackedArray.of(kind, getattr(plain, name)).packed())
        assert getattr(wire, name).packed() is kept  # sent from where it lies, not packed again
    assert wire.tokens.sign_checked
    assert frame_of(replayed) == frame_of(plain)
    replayed.tokens[0] = 11  # a hook's change after loading: the bytes are dropped, the change is sent
    assert replayed.tokens.packed("i") is None and frame_of(replayed) != frame_of(plain)


@pytest.mark.parametrize(("field", "index", "value"), [
    ("tokens", 0, 2**31),  # int64 in the dump: over the channel's int32
    ("tokens", 5, -4),  # negative: the channel refuses it
    ("loss_mask", 0, 200),  # int32 in the dump: no int8 packing
    ("loss_mask", 1, -1),  # int8 in the dump, but negative: not the bytes of a uint8 packing
])
def test_a_dumps_array_that_is_not_the_channels_bytes_is_packed_as_a_list(
        tmp_path: object, field: str, index: int, value: int) -> None:
    plain = sample()
    getattr(plain, field)[index] = value
    path = write_dump(tmp_path / "0.rld", 0, [plain], config_facts={})  # type: ignore[operator]
    replayed = read_dump(path).samples[0]
    assert getattr(replayed, field) == getattr(plain, field)
    kinds = dict(CHANNEL_FIELDS)
    for name in ("tokens", "loss_mask", "rollout_log_probs"):
        assert (getattr(replayed, name).packed(kinds[name].typecode) is None) is (name == field)
    try:  # the same frame, or the same refusal, as the plain lists
        expected: object = frame_of(plain)
    except Exception as error:  # compared below
        with pytest.raises(type(error), match=re.escape(str(error))):
            frame_of(replayed)
    else:
        assert frame_of(replayed) == expected
