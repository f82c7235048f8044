"""The node registry's wire contract: what node k and node 0 say to each other over one TCP connection.

Owns the registry's messages and `NODES`, their family in the one message layer (`workers.protocol.messages`,
which the control channel's messages are a family of too: one framing, one strict decoder, one bounded hello
decoder). Both ends are `rayless train` (node 0's `registry`, node k's `agent`), so the messages live here,
beside them. No extension types: nothing but plain values is ever decoded.

The conversation: node k sends `NodeHello`; node 0 answers `NodeWelcome` (the directories whose sharing node k
must check) or `NodeRefused` (why) and closes. Then node k reports `SharedDirs`, `EngineUp`, `EngineExited`,
`EngineFailed`, `TorchrunExited`; node 0 sends `RelaunchEngine` and, at the end, `NodeShutdown`. Both send
`Ping` every `HEARTBEAT_S`; a side that hears nothing for `SILENCE_S` counts the other as lost.

Invariants (the family's): before the token is checked only a NodeHello of at most `MAX_HELLO_BYTES` is read,
its kind and version first, then exactly its fields and types; after that a frame is at most
`MAX_FRAME_BYTES`; unknown kinds and fields are refused (`WireError`).
"""

from __future__ import annotations

from typing import Annotated

import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from workers import protocol
from workers.protocol import Family, Int31, Message, Token

VERSION = 1
MAX_HELLO_BYTES = protocol.MAX_HELLO_BYTES
MAX_FRAME_BYTES = 1 << 20
HEARTBEAT_S = 5.0
SILENCE_S = 4 * HEARTBEAT_S
MAX_HOST_CHARS = 255


class WireError(protocol.ProtocolError):
    """The peer sent something the registry contract does not allow."""


class WireVersionMismatch(WireError, protocol.VersionMismatch):
    """A node's hello names another registry version."""


class NodeMessage(Message):
    """The base of the node registry's kinds."""


class NodeHello(NodeMessage, tag="node_hello"):
    version: Int31
    token: Token
    node_rank: Int31
    num_nodes: Int31
    pid: Int31
    host: Annotated[str, msgspec.Meta(max_length=MAX_HOST_CHARS)]


class NodeWelcome(NodeMessage, tag="node_welcome"):
    #: [directory, marker file name, marker content]: node 0 wrote each; node k says whether it sees them
    markers: list[list[str]] = msgspec.field(default_factory=list)


class NodeRefused(NodeMessage, tag="node_refused"):
    reason: str


class SharedDirs(NodeMessage, tag="shared_dirs"):
    #: the directories of the welcome's markers that this node does not see as node 0 wrote them
    not_shared: list[str] = msgspec.field(default_factory=list)


class EngineUp(NodeMessage, tag="engine_up"):
    name: str
    url: str
    pid: int


class EngineExited(NodeMessage, tag="engine_exited"):
    name: str
    status: int


class TorchrunExited(NodeMessage, tag="torchrun_exited"):
    status: int


class RelaunchEngine(NodeMessage, tag="relaunch_engine"):
    """Start the named engine again; `model_path` / `weight_version` for this incarnation ("" to keep its own)."""

    name: str
    model_path: str = ""
    weight_version: str = ""


class EngineFailed(NodeMessage, tag="engine_failed"):
    name: str
    error: str


class NodeShutdown(NodeMessage, tag="node_shutdown"):
    ok: bool
    reason: str = ""


class Ping(NodeMessage, tag="ping"):
    pass


NODES = Family(
    "node registry", NodeMessage, hello=NodeHello, version=VERSION, version_field="version", peer="node",
    us="node 0", max_frame_bytes=MAX_FRAME_BYTES, max_hello_bytes=MAX_HELLO_BYTES, error=WireError,
    version_error=WireVersionMismatch,
)  # fmt: skip


def encode(message: NodeMessage, limit: int = MAX_FRAME_BYTES) -> bytes:
    return NODES.encode(message, limit)


def decode(body: bytes) -> NodeMessage:
    """A message after the handshake (not a NodeHello): a known kind with exactly its fields and types."""
    return NODES.decode(body)  # type: ignore[return-value]


def decode_node_hello(body: bytes) -> NodeHello:
    """A NodeHello from a peer that has not proven the token: bounded lengths, exact fields and types."""
    return NODES.decode_hello(body)  # type: ignore[return-value]


async def send(stream: anyio.abc.ByteStream, message: NodeMessage) -> None:
    await NODES.send(stream, message)


async def receive(stream: BufferedByteReceiveStream, limit: int = MAX_FRAME_BYTES) -> NodeMessage:
    """The next message; anyio.IncompleteRead / EndOfStream when the peer closed."""
    return await NODES.receive(stream, limit)  # type: ignore[return-value]


async def receive_hello(stream: BufferedByteReceiveStream) -> NodeHello:
    return await NODES.receive_hello(stream)  # type: ignore[return-value]
