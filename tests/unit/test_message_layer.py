"""The one message layer: the control channel and the node registry are families of one implementation, and
whatever bytes a peer sends either decode to one of the family's messages or raise the family's
`ProtocolError` — never another exception — at a memory cost bounded by the frame's size.

The properties run on random bytes; on msgpack of random values (every msgpack type: integers past int64,
floats, binary, nested lists and maps, extension types, tensor payloads with hostile shapes); on real messages
with a field replaced, added or removed; and on real frames with a byte changed, cut or inserted. Header bombs
(a length claiming 2**32 - 1 items in a few bytes) and nesting past the interpreter's limit are explicit cases.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import pytest
import torch  # imported here so that a tensor payload's first decode does not count its import as memory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.nodes import wire
from tests.support.train_settings import init_command
from workers import protocol
from workers.protocol import messages

Decoder = tuple[Callable[[bytes], Any], type[protocol.ProtocolError]]
DECODERS: dict[str, Decoder] = {
    "control channel": (protocol.decode_body, protocol.ProtocolError),
    "control hello": (protocol.decode_hello, protocol.ProtocolError),
    "control plain body": (protocol.unpack, protocol.ProtocolError),
    "node registry": (wire.decode, wire.WireError),
    "node hello": (wire.decode_node_hello, wire.WireError),
}
#: what decoding a body may cost: the values it decodes to (an empty list or map is ~60 bytes per body byte)
BYTES_PER_BODY_BYTE = 100
FIXED_COST = 256 * 1024


def control_messages() -> list[protocol.ControlMessage]:
    sample = protocol.WireSample([1, 2, 3], 1, [1], [-0.5], advantage=0.5)
    metrics = protocol.StepMetrics(1.0, 1.0, 4.0, 1.0, 2.0, 0.0, 0.5, 12.0, 0.25, 1.5, 1e-3, 0.1, extra={"m": 1.0})
    return [
        protocol.Hello(protocol.PROTOCOL_VERSION, "t" * 64, 1, 2, 1, 4242, node_rank=1),
        protocol.Welcome(),
        protocol.ErrorMessage("no"),
        protocol.Request(1, init_command({"model_path": "/m", "hook_args": {"a": [1, 2]}})),
        protocol.Request(2, protocol.TrainCommand(3, [[sample, sample], []], [2, 0])),
        protocol.Request(3, protocol.SaveCommand(3, "/ckpt", {"epoch": 1})),
        protocol.Request(4, protocol.BroadcastWeightsCommand("127.0.0.1", 29500, 3)),
        protocol.Request(5, protocol.SaveCommand(4, "/ckpt", {"tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3)})),
        protocol.Response(6, True, protocol.TrainResult([metrics])),
        protocol.Response(7, True, protocol.LoadReply(rollout_id=3, extra={"epoch": 1}, path="/ckpt/rollout_3")),
    ]


def node_messages() -> list[wire.NodeMessage]:
    return [
        wire.NodeHello(version=wire.VERSION, token="t" * 64, node_rank=1, num_nodes=2, pid=42, host="gpu2"),
        wire.NodeWelcome(markers=[["/d", "m", "n"]]),
        wire.NodeRefused(reason="no"),
        wire.SharedDirs(not_shared=["/d"]),
        wire.EngineUp(name="rollout-1", url="http://127.0.0.1:1", pid=7),
        wire.EngineExited(name="rollout-1", status=-9),
        wire.TorchrunExited(status=0),
        wire.RelaunchEngine(name="rollout-1", model_path="/m"),
        wire.EngineFailed(name="rollout-1", error="boom"),
        wire.NodeShutdown(ok=True),
        wire.Ping(),
    ]


def frames() -> list[bytes]:
    return [protocol.encode_frame(m) for m in control_messages()] + [wire.encode(m) for m in node_messages()]


def plain(message: messages.Message) -> dict[Any, Any]:
    """A real message as the plain map a peer could have sent (a tensor left as its extension type)."""
    frame = protocol.encode_frame(message) if isinstance(message, protocol.ControlMessage) else wire.encode(message)
    return msgpack.unpackb(frame[4:])


# -------------------------------------------------------------------------------------------- strategies

TENSORS = st.builds(
    lambda dtype, shape, raw: msgpack.ExtType(protocol.TENSOR_EXT, msgpack.packb([dtype, shape, raw])),
    st.sampled_from(["float32", "bfloat16", "int64", "bool", "nope", "Tensor", "__class__"]),
    st.lists(st.integers(min_value=-2, max_value=2**64 - 1) | st.sampled_from([0, 1, 2, 2**48]), max_size=70),
    st.binary(max_size=64),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=20),
    st.builds(msgpack.ExtType, st.integers(min_value=0, max_value=127), st.binary(max_size=16)), TENSORS,
)  # fmt: skip
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=4),
    max_leaves=20,
)
FIELD_NAMES = st.sampled_from(
    ["kind", "token", "rank", "world_size", "protocol_version", "version", "command", "steps", "result", "tokens",
     "markers", "host", "pid", "node_rank", "request_id", "ok", "extra", "config"]
) | st.text(max_size=8)  # fmt: skip
MESSAGES = st.sampled_from(control_messages() + node_messages())


@st.composite
def changed_messages(draw: st.DrawFn) -> bytes:
    """A real message with one field replaced, added or removed, or its command's fields changed the same way."""
    body = plain(draw(MESSAGES))
    target = body["command"] if "command" in body and draw(st.booleans()) else body
    action = draw(st.sampled_from(["replace", "add", "remove"]))
    if action == "remove" and target:
        target.pop(draw(st.sampled_from(sorted(target, key=str))))
    elif action == "replace" and target:
        target[draw(st.sampled_from(sorted(target, key=str)))] = draw(VALUES)
    else:
        target[draw(FIELD_NAMES)] = draw(VALUES)
    return msgpack.packb(body, use_bin_type=True)


@st.composite
def changed_frames(draw: st.DrawFn) -> bytes:
    """A real frame's body with one byte changed, the body cut short, or random bytes inserted."""
    body = bytearray(draw(st.sampled_from(frames()))[4:])
    at = draw(st.integers(min_value=0, max_value=len(body) - 1))
    action = draw(st.sampled_from(["flip", "cut", "insert"]))
    if action == "flip":
        body[at] = draw(st.integers(min_value=0, max_value=255))
    elif action == "cut":
        del body[at:]
    else:
        body[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(body)


BODIES = st.one_of(
    st.binary(max_size=256),
    VALUES.map(lambda value: msgpack.packb(value, use_bin_type=True)),
    changed_messages(),
    changed_frames(),
)


# ------------------------------------------------------------------------------------------------ checks


@contextmanager
def traced() -> Iterator[None]:
    for frame in frames():  # the decoders are built on first use: not a cost of the body
        for name in DECODERS:
            decode_bounded(name, frame[4:], measure=False)
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def decode_bounded(name: str, body: bytes, *, measure: bool = True) -> Any:
    """Decode with `name`'s decoder: its result, or None for its ProtocolError (any other exception fails the
    test); the peak memory it took is at most proportional to the body."""
    decode, error = DECODERS[name]
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    try:
        result = decode(body)
    except error:
        result = None
    peak = tracemalloc.get_traced_memory()[1] - before
    if measure:
        assert peak <= BYTES_PER_BODY_BYTE * len(body) + FIXED_COST, f"{name}: {peak} B for a {len(body)} B body"
    return result


@settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODIES)
def test_any_body_is_a_message_of_the_family_or_its_protocol_error(body: bytes) -> None:
    with traced():
        for name in DECODERS:
            result = decode_bounded(name, body)
            if result is not None and name != "control plain body":
                family = protocol.CONTROL if name.startswith("control") else wire.NODES
                assert isinstance(result, family.base), (name, result)
                is_hello = isinstance(result, family.hello)
                assert is_hello == name.endswith("hello"), f"{name} decoded a {result.kind}"


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_a_length_header_claiming_more_than_the_body_holds_allocates_nothing(name: str) -> None:
    claims = {
        "array": b"\xdd\xff\xff\xff\xff", "map": b"\xdf\xff\xff\xff\xff", "str": b"\xdb\xff\xff\xff\xff",
        "bin": b"\xc6\xff\xff\xff\xff", "ext": b"\xc9\xff\xff\xff\xff\x01",
    }  # fmt: skip
    fields = [b"\xa4kind", b"\xa8response", b"\xaarequest_id", b"\x01", b"\xa2ok", b"\xc3", b"\xa6result"]
    prefix = b"\x84" + b"".join(fields)  # a Response whose `result` is the claim
    deep = prefix + b"\x81\xa1x" + b"\x91" * 100_000 + b"\x90"  # nested past the interpreter's limit
    with traced():
        for what, claim in claims.items():
            for body in (claim, prefix + claim, claim + b"\x00" * 64):
                assert decode_bounded(name, body) is None, (what, body[:12])
        assert decode_bounded(name, deep) is None


def test_every_real_message_survives_its_family_and_only_its_own() -> None:
    for message in control_messages():
        body = protocol.encode_frame(message)[4:]
        decode = protocol.decode_hello if isinstance(message, protocol.Hello) else protocol.decode_body
        assert protocol.encode_frame(decode(body)) == protocol.encode_frame(message)
        with pytest.raises(wire.WireError, match=r"unknown message kind|expected node_hello"):
            (wire.decode_node_hello if isinstance(message, protocol.Hello) else wire.decode)(body)
    for message in node_messages():
        body = wire.encode(message)[4:]
        decode = wire.decode_node_hello if isinstance(message, wire.NodeHello) else wire.decode
        assert decode(body) == message
        with pytest.raises(protocol.ProtocolError, match=r"unknown message kind|expected hello"):
            (protocol.decode_hello if isinstance(message, wire.NodeHello) else protocol.decode_body)(body)


# ----------------------------------------------------------------------------------- one implementation


def test_both_contracts_are_families_of_the_one_message_layer() -> None:
    assert messages.FAMILIES["control channel"] is protocol.CONTROL
    assert messages.FAMILIES["node registry"] is wire.NODES
    for family, hello in ((protocol.CONTROL, protocol.Hello), (wire.NODES, wire.NodeHello)):
        assert type(family) is messages.Family and family.hello is hello
        kinds = family.kinds()
        assert hello.kind in kinds and all(issubclass(cls, messages.Message) for cls in kinds.values())
    assert issubclass(wire.WireError, protocol.ProtocolError)
    assert issubclass(protocol.StepMetrics, messages.Record) and issubclass(protocol.WireSample, messages.Record)
    # one framing: the same header in front of both families' bodies
    for frame in (protocol.encode_frame(protocol.Welcome()), wire.encode(wire.Ping())):
        assert protocol.HEADER.unpack(frame[:4]) == (len(frame) - 4,)


def test_every_message_kind_anywhere_belongs_to_exactly_one_family() -> None:
    pending, seen = [messages.Message], []
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.kind != cls.__name__:
            owners = [name for name, family in messages.FAMILIES.items() if issubclass(cls, family.base)]
            assert len(owners) == 1, f"{cls.__name__} ({cls.kind}) belongs to {owners}"
            seen.append(cls.kind)
    assert {"hello", "request", "response", "train", "node_hello", "engine_up", "ping"} <= set(seen)
    with pytest.raises(ValueError, match="exists already"):
        messages.Family("node registry", wire.NodeMessage, hello=wire.NodeHello, version=1, version_field="version",
                        peer="node", us="node 0", max_frame_bytes=1)
