"""The node registry's wire contract: what node k and node 0 say to each other over one TCP connection.

Owns the messages and their framing. Both ends are `rayless train` (node 0's `registry`, node k's `agent`),
so the contract lives here, beside them, not in `workers.protocol` (which the ranks share). Frames are the
control channel's: a 4-byte big-endian length, then a msgpack map with a `kind`; no extension types, so
nothing but plain values is ever decoded.

The conversation: node k sends `NodeHello` (protocol version, token, node rank, node count, pid, host name);
node 0 checks it and answers `NodeWelcome` (the directories whose sharing node k must check) or
`NodeRefused` (why) and closes. Then node k reports `SharedDirs`, `EngineUp` (an engine it launched answers at
a URL), `EngineExited`, `EngineFailed` (it could not start one), `TorchrunExited`; node 0 sends `RelaunchEngine` and, at the end,
`NodeShutdown` (whether the run succeeded). Both send `Ping` every `HEARTBEAT_S`; a side that hears nothing
for `SILENCE_S` counts the other as lost (a node that lost power sends no FIN).

Invariants: before the token is checked only a NodeHello of at most `MAX_HELLO_BYTES` is read, decoded with
msgpack told the largest lengths it may have, and each field's type and range checked (`decode_node_hello`);
after that a frame is at most `MAX_FRAME_BYTES`; unknown kinds and fields are refused (`WireError`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import anyio.abc
import msgpack
from anyio.streams.buffered import BufferedByteReceiveStream

from workers import protocol

VERSION = 1
MAX_HELLO_BYTES = 4096
MAX_FRAME_BYTES = 1 << 20
HEARTBEAT_S = 5.0
SILENCE_S = 4 * HEARTBEAT_S
MAX_HOST_CHARS = 255


class WireError(protocol.ProtocolError):
    """The peer sent something the registry contract does not allow."""


_KINDS: dict[str, type[NodeMessage]] = {}


@dataclass
class NodeMessage:
    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            _KINDS[cls.kind] = cls

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


@dataclass
class NodeHello(NodeMessage):
    kind: ClassVar[str] = "node_hello"
    version: int
    token: str
    node_rank: int
    num_nodes: int
    pid: int
    host: str


@dataclass
class NodeWelcome(NodeMessage):
    kind: ClassVar[str] = "node_welcome"
    #: [directory, marker file name, marker content]: node 0 wrote each; node k says whether it sees them
    markers: list[list[str]] = field(default_factory=list)


@dataclass
class NodeRefused(NodeMessage):
    kind: ClassVar[str] = "node_refused"
    reason: str


@dataclass
class SharedDirs(NodeMessage):
    kind: ClassVar[str] = "shared_dirs"
    #: the directories of the welcome's markers that this node does not see as node 0 wrote them
    not_shared: list[str] = field(default_factory=list)


@dataclass
class EngineUp(NodeMessage):
    kind: ClassVar[str] = "engine_up"
    name: str
    url: str
    pid: int


@dataclass
class EngineExited(NodeMessage):
    kind: ClassVar[str] = "engine_exited"
    name: str
    status: int


@dataclass
class TorchrunExited(NodeMessage):
    kind: ClassVar[str] = "torchrun_exited"
    status: int


@dataclass
class RelaunchEngine(NodeMessage):
    """Start the named engine again; `model_path` / `weight_version` for this incarnation ("" to keep its own)."""

    kind: ClassVar[str] = "relaunch_engine"
    name: str
    model_path: str = ""
    weight_version: str = ""


@dataclass
class EngineFailed(NodeMessage):
    kind: ClassVar[str] = "engine_failed"
    name: str
    error: str


@dataclass
class NodeShutdown(NodeMessage):
    kind: ClassVar[str] = "node_shutdown"
    ok: bool
    reason: str = ""


@dataclass
class Ping(NodeMessage):
    kind: ClassVar[str] = "ping"


def encode(message: NodeMessage, limit: int = MAX_FRAME_BYTES) -> bytes:
    body = msgpack.packb(message.to_wire(), use_bin_type=True)
    if len(body) > limit:
        raise WireError(f"a {message.kind} message of {len(body)} bytes is over the {limit}-byte limit")
    return protocol.HEADER.pack(len(body)) + body


def _no_ext(code: int, data: bytes) -> Any:
    raise WireError("the node registry carries no extension types")


def decode(body: bytes) -> NodeMessage:
    try:
        obj = msgpack.unpackb(body, raw=False, ext_hook=_no_ext, strict_map_key=True)
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"malformed frame: {exc}"[:300]) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise WireError("expected a message map with a 'kind'")
    cls = _KINDS.get(obj["kind"])
    if cls is None or cls is NodeHello:
        raise WireError(f"unexpected message kind {obj['kind']!r:.40}")
    values = {key: value for key, value in obj.items() if key != "kind"}
    return _build(cls, values)


def _build(cls: type[NodeMessage], values: dict[str, Any]) -> NodeMessage:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(fields)
    if unknown:
        raise WireError(f"{cls.kind} has unknown fields {sorted(unknown)}")
    try:
        message = cls(**values)
    except TypeError as exc:
        raise WireError(f"{cls.kind}: {exc}") from None
    for name, spec in fields.items():
        if not _has_type(getattr(message, name), str(spec.type)):
            raise WireError(f"{cls.kind}.{name} must be a {spec.type}")
    return message


def _has_type(value: Any, annotation: str) -> bool:
    scalars = {"int": int, "str": str, "bool": bool}
    if annotation in scalars:
        return type(value) is scalars[annotation]
    if annotation == "list[str]":
        return isinstance(value, list) and all(type(item) is str for item in value)
    if annotation == "list[list[str]]":
        return isinstance(value, list) and all(_has_type(item, "list[str]") for item in value)
    raise AssertionError(f"no wire check for the annotation {annotation!r}")


def decode_node_hello(body: bytes) -> NodeHello:
    """A NodeHello from a peer that has not proven the token: bounded lengths, exact fields and types."""
    if len(body) > MAX_HELLO_BYTES:
        raise WireError(f"a hello of {len(body)} bytes is over the {MAX_HELLO_BYTES}-byte handshake limit")
    try:
        obj = msgpack.unpackb(body, raw=False, ext_hook=_no_ext, max_str_len=protocol.MAX_TOKEN_CHARS,
                              max_bin_len=0, max_array_len=0, max_map_len=8, max_ext_len=0)
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"malformed hello: {exc}"[:300]) from None
    if not isinstance(obj, dict) or obj.get("kind") != NodeHello.kind:
        raise WireError("expected node_hello as the first message")
    values = {key: value for key, value in obj.items() if key != "kind"}
    if set(values) != {f.name for f in dataclasses.fields(NodeHello)}:
        raise WireError(f"node_hello needs exactly the fields {[f.name for f in dataclasses.fields(NodeHello)]}")
    for name in ("version", "node_rank", "num_nodes", "pid"):
        if type(values[name]) is not int or not 0 <= values[name] < 1 << 31:
            raise WireError(f"node_hello.{name} must be an integer in 0..{(1 << 31) - 1}")
    if type(values["token"]) is not str or type(values["host"]) is not str or len(values["host"]) > MAX_HOST_CHARS:
        raise WireError("node_hello.token and node_hello.host must be strings (host at most 255 characters)")
    return NodeHello(**values)


async def send(stream: anyio.abc.ByteStream, message: NodeMessage) -> None:
    await stream.send(encode(message))


async def receive(stream: BufferedByteReceiveStream, limit: int = MAX_FRAME_BYTES) -> NodeMessage:
    """The next message; anyio.IncompleteRead / EndOfStream when the peer closed."""
    (length,) = protocol.HEADER.unpack(await stream.receive_exactly(protocol.HEADER.size))
    if length > limit:
        raise WireError(f"peer announced a frame of {length} bytes, over the {limit}-byte limit")
    return decode(await stream.receive_exactly(length))


async def receive_hello(stream: BufferedByteReceiveStream) -> NodeHello:
    (length,) = protocol.HEADER.unpack(await stream.receive_exactly(protocol.HEADER.size))
    if length > MAX_HELLO_BYTES:
        raise WireError(f"peer announced a first frame of {length} bytes; a hello is at most {MAX_HELLO_BYTES}")
    return decode_node_hello(await stream.receive_exactly(length))
