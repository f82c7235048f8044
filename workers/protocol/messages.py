"""The one message layer: typed messages on length-prefixed msgpack frames, for every contract of ours.

Owns `Record`, `TaggedRecord` and `Message` (msgspec structs: strict types, exactly their fields), `Family` (one contract: its
kinds, version, limits and hello; strict decoding of its frames, bounded decoding of its hello) and `FAMILIES`,
the registry of every family. The control channel (`workers.protocol.control`) and the node registry
(`coordinator.nodes.wire`) are families of it; why msgspec: docs/architecture.md#decisions.

Invariants:
- A family decodes only its own kinds, each field type-checked while decoding (no value is built before its
  type is known); anything else raises the family's `error`, a `ProtocolError`, never another exception.
- Before a peer is authenticated only its hello is decoded: a body of at most `max_hello_bytes`, its kind and
  version read first (a peer of another version is told so whatever else it sent), then exactly the hello's
  fields and types, no extension type.
- A frame over the limit is refused by the sender before writing and by the receiver after its header.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, TypeVar, Union

import msgspec

from workers.protocol.frames import (
    HEADER,
    MAX_HELLO_BYTES,
    MAX_TOKEN_CHARS,
    ProtocolError,
    VersionMismatch,
    check_body_length,
    read_frame,
    read_hello_frame,
)

if TYPE_CHECKING:
    from anyio.abc import ByteStream
    from anyio.streams.buffered import BufferedByteReceiveStream

R = TypeVar("R", bound="Record")
T = TypeVar("T", bound="TaggedRecord")

#: the integers a hello carries (versions, ranks, counts, pids): 0 .. 2**31 - 1
Int31 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
#: a token as a hello carries it: longer ones are refused unread
Token = Annotated[str, msgspec.Meta(max_length=MAX_TOKEN_CHARS)]

_KIND_NAME = re.compile(r"[a-z][a-z0-9_]*")
_BAD_KIND = re.compile(r"Invalid value (.*) - at `\$(.*)\.kind`")


class _KindOf:
    """`Cls.kind` and `message.kind`: the tag msgspec writes in the `kind` field."""

    def __get__(self, obj: object, owner: type[msgspec.Struct]) -> str:
        return owner.__struct_config__.tag  # type: ignore[return-value]


class Record(msgspec.Struct, forbid_unknown_fields=True):
    """A typed value: exactly its fields, each type-checked when decoded (a sample, one step's metrics)."""

    def to_wire(self) -> dict[str, Any]:
        """Plain values (for a record carried inside a message's free-form map)."""
        return msgspec.to_builtins(self, builtin_types=(bytes, bytearray, memoryview))

    @classmethod
    def from_wire(cls: type[R], obj: Any) -> R:
        """The record from plain values; ProtocolError naming the field otherwise."""
        try:
            return msgspec.convert(obj, cls)
        except msgspec.MsgspecError as exc:
            raise ProtocolError(f"a {cls.__name__}: {exc}"[:300]) from None


class TaggedRecord(Record, tag_field="kind"):
    """A record of a tagged union: a subclass declared with `tag="snake_name"` is a kind (that name travels in
    its `kind` field); one declared without is abstract, never on the wire. A value inside a message that is
    one of several records (a rank's reply, `workers.protocol.replies`) is one of these."""

    kind: ClassVar[str] = _KindOf()  # type: ignore[assignment]


class Message(TaggedRecord):
    """A message of one family. A subclass declared with `tag="snake_name"` is a kind (that name travels in the
    frame's `kind` field); one declared without (a family's base, `Command`) is abstract, never on the wire."""


def _concrete(cls: type[TaggedRecord]) -> bool:
    tag = cls.__struct_config__.tag
    if tag == cls.__name__:  # msgspec's default tag: no `tag=` was given
        return False
    if not isinstance(tag, str) or not _KIND_NAME.fullmatch(tag):
        raise TypeError(f"message {cls.__name__} has tag {tag!r}; a kind is a snake_case name")
    return True


def kinds(base: type[T]) -> dict[str, type[T]]:
    """Every concrete kind under `base`, by name; TypeError for a kind declared twice."""
    found: dict[str, type[T]] = {}
    pending = [base]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if _concrete(cls) and found.setdefault(cls.kind, cls) is not cls:
            raise TypeError(f"kind {cls.kind!r} is declared twice ({found[cls.kind].__name__}, {cls.__name__})")
    return dict(sorted(found.items()))


def union_of(base: type[TaggedRecord]) -> Any:
    """The type 'any kind under `base`', for a field that holds one (a request's command)."""
    return Union[tuple(kinds(base).values())]  # noqa: UP007 - a tuple of types needs Union[...]


FAMILIES: dict[str, Family] = {}


class Family:
    """One contract's messages: the concrete subclasses of `base`, with their version, limits and hello."""

    def __init__(
        self,
        name: str,
        base: type[Message],
        *,
        hello: type[Message],
        version: int,
        version_field: str,
        peer: str,
        us: str,
        max_frame_bytes: int,
        max_hello_bytes: int = MAX_HELLO_BYTES,
        error: type[ProtocolError] = ProtocolError,
        version_error: type[VersionMismatch] = VersionMismatch,
        enc_hook: Callable[[Any], Any] | None = None,
        ext_hook: Callable[[int, memoryview], Any] | None = None,
        limit_hint: str = "",
    ) -> None:
        if name in FAMILIES:
            raise ValueError(f"a message family named {name!r} exists already")
        self.name, self.base, self.hello, self.version = name, base, hello, version
        self.version_field, self.peer, self.us = version_field, peer, us
        self.max_frame_bytes, self.max_hello_bytes = max_frame_bytes, max_hello_bytes
        self.error, self.version_error = error, version_error
        self.limit_hint = limit_hint
        self._ext_hook = ext_hook
        self._encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
        FAMILIES[name] = self

    # ----------------------------------------------------------------------------------------- the kinds

    def kinds(self) -> dict[str, type[Message]]:
        """Every kind of the family, by name."""
        return kinds(self.base)

    @cached_property
    def _decoder(self) -> msgspec.msgpack.Decoder[Any]:
        after_hello = [cls for cls in self.kinds().values() if cls is not self.hello]
        return msgspec.msgpack.Decoder(Union[tuple(after_hello)], ext_hook=self._ext_hook)  # noqa: UP007

    @cached_property
    def _hello_decoder(self) -> msgspec.msgpack.Decoder[Any]:
        return msgspec.msgpack.Decoder(self.hello)  # no ext_hook: an extension type is a type error

    @cached_property
    def _probe(self) -> msgspec.msgpack.Decoder[Any]:
        probe = msgspec.defstruct("HelloProbe", [("kind", Any, None), (self.version_field, Any, None)])
        return msgspec.msgpack.Decoder(probe)

    # ------------------------------------------------------------------------------------- encode/decode

    def encode(self, message: Message, limit: int | None = None) -> bytearray:
        """The message's frame; the family's error (FrameTooLarge on the control channel) over `limit`. Encoded
        after a reserved header, in one buffer: a large frame is never copied to prepend its length."""
        try:
            frame = bytearray(HEADER.size)
            self._encoder.encode_into(message, frame, HEADER.size)
            check_body_length(len(frame) - HEADER.size, self.max_frame_bytes if limit is None else limit,
                              self._adjective, self.limit_hint)
            HEADER.pack_into(frame, 0, len(frame) - HEADER.size)
            return frame
        except ProtocolError as exc:
            raise self._as_error(exc) from None
        except Exception as exc:
            raise self.error(f"{self.name}: cannot encode a {message.kind} message: {exc}"[:300]) from None

    def decode(self, body: bytes) -> Message:
        """A message after the handshake: one of the family's kinds except the hello, strictly typed."""
        try:
            return self._decoder.decode(body)
        except ProtocolError as exc:
            raise self._as_error(exc) from None
        except Exception as exc:  # msgspec's errors, RecursionError past the interpreter's nesting limit
            raise self.error(f"{self.name}: {self._explain(exc)}"[:300]) from None

    def convert(self, obj: Any) -> Message:
        """A message from plain values already decoded (tests, tools); the same checks as `decode`."""
        try:
            return msgspec.convert(obj, self._decoder.type)
        except Exception as exc:
            raise self.error(f"{self.name}: {self._explain(exc)}"[:300]) from None

    def decode_hello(self, body: bytes) -> Message:
        """The hello of a peer that has not proven the token: bounded by the body, kind and version first."""
        if len(body) > self.max_hello_bytes:
            raise self.error(f"a hello of {len(body)} bytes is over the {self.max_hello_bytes}-byte handshake limit")
        try:
            probe = self._probe.decode(body)
        except Exception:  # not a map, or malformed: the strict decode below names the problem
            probe = None
        if probe is not None:
            kind, version = probe.kind, getattr(probe, self.version_field)
            if kind != self.hello.kind:
                raise self.error(f"{self.name}: expected {self.hello.kind} as the first message, got {kind!r:.40}")
            if type(version) is int and version != self.version:
                raise self.version_error(
                    f"protocol version mismatch: {self.peer} speaks {version}, {self.us} speaks {self.version} "
                    f"({self.name}); run the same rayless version on both sides"
                )
        try:
            return self._hello_decoder.decode(body)
        except Exception as exc:
            raise self.error(f"{self.name}: malformed hello: {self._explain(exc)}"[:300]) from None

    # ---------------------------------------------------------------------------------------- on a stream

    async def send(self, stream: ByteStream, message: Message, limit: int | None = None) -> None:
        await stream.send(self.encode(message, limit))

    async def receive(self, stream: BufferedByteReceiveStream, limit: int | None = None) -> Message:
        """The next message; anyio.IncompleteRead / EndOfStream when the peer closed."""
        try:
            body = await read_frame(stream, self.max_frame_bytes if limit is None else limit, self._adjective)
        except ProtocolError as exc:
            raise self._as_error(exc) from None
        return self.decode(body)

    async def receive_hello(self, stream: BufferedByteReceiveStream) -> Message:
        """An unauthenticated peer's first frame: at most `max_hello_bytes`, decoded by `decode_hello`."""
        try:
            body = await read_hello_frame(stream, self.max_hello_bytes)
        except ProtocolError as exc:
            raise self._as_error(exc) from None
        return self.decode_hello(body)

    # -------------------------------------------------------------------------------------------- errors

    @property
    def _adjective(self) -> str:
        return self.name.replace(" ", "-")

    def _as_error(self, exc: ProtocolError) -> ProtocolError:
        return exc if isinstance(exc, self.error) else self.error(str(exc))

    def _explain(self, exc: Exception) -> str:
        if isinstance(exc, RecursionError):
            return "the body is nested deeper than the decoder allows"
        text = str(exc)
        bad = _BAD_KIND.fullmatch(text)
        if bad and bad[2]:  # a field of the message (a request's command) holds a kind that does not fit there
            return f"unknown message kind {bad[1]:.40} at `${bad[2]}`"
        if bad:
            known = [kind for kind in self.kinds() if kind != self.hello.kind]
            return f"unknown message kind {bad[1]:.40} (known after the {self.hello.kind}: {', '.join(known)})"
        return text
