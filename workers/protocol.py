"""The control channel between the coordinator and the training ranks: frames, messages, handshake.

Owns the wire contract, shared by both sides (`coordinator.train` and `workers.train_rank`): 4-byte big-endian
length + msgpack body frames (tensors as the `TENSOR_EXT` extension, never pickle), the message dataclasses and
`Record`s (`WireSample`, `StepMetrics`) decoded strictly by `decode_message`, `PROTOCOL_VERSION`, and the
Hello → Welcome / ErrorMessage handshake, then `Request` / `Response` pairs by request id. It imports no
coordinator code and no torch at import time; one module so that either side finds the whole contract here. The
contract in prose: docs/architecture.md.

Invariants:
- A frame is never written or accepted beyond the limit (the receiver refuses after reading only the header).
- Unknown kinds and unknown or missing fields are a `ProtocolError` naming the problem; changing a record
  changes `PROTOCOL_VERSION`.
- Before the token is checked (`hmac.compare_digest`), nothing but a Hello of at most `MAX_HELLO_BYTES` is read,
  decoded by `decode_hello` alone (flat, bounded, no extension type, exactly Hello's fields and types).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgpack

if TYPE_CHECKING:
    from anyio.abc import ByteStream
    from anyio.streams.buffered import BufferedByteReceiveStream

T = TypeVar("T")

PROTOCOL_VERSION = 5  # 3: StepMetrics.extra (hook metrics); 4: offload / onload (colocation); 5: Hello.node
MAX_FRAME_BYTES = 256 * 1024 * 1024
#: the most a peer may send before its token is checked: one Hello (a real one is ~150 bytes)
MAX_HELLO_BYTES = 4096
#: a token longer than this is refused unread (the coordinator's own are 64 hex characters)
MAX_TOKEN_CHARS = 1024
#: tensors of more dimensions, or dimensions over this size, are refused before any arithmetic on them
MAX_TENSOR_DIMS = 64
MAX_TENSOR_DIM = 1 << 48
TENSOR_EXT = 1
HEADER = struct.Struct(">I")

ENV_TOKEN = "RAYLESS_CONTROL_TOKEN"
ENV_ADDR = "RAYLESS_CONTROL_ADDR"
ENV_MAX_FRAME = "RAYLESS_CONTROL_MAX_FRAME_BYTES"
#: the node (of a multi-node run) whose torchrun started the rank; reported in Hello
ENV_NODE_RANK = "RAYLESS_NODE_RANK"


class ProtocolError(RuntimeError):
    """The peer sent something this side cannot accept (bad frame, unknown message, wrong field)."""


class FrameTooLarge(ProtocolError):
    """A frame is over the configured limit; raised by the sender before writing, by the receiver on read."""


class VersionMismatch(ProtocolError):
    """The peer's Hello names another protocol version (the message says both)."""


class HandshakeRefused(ProtocolError):
    """The coordinator refused this rank (wrong token, wrong protocol version, unexpected rank)."""


# ----------------------------------------------------------------------------------------------- tensors


def _encode_default(obj: Any) -> Any:
    torch = _torch_if_loaded()
    if torch is not None and isinstance(obj, torch.Tensor):
        tensor = obj.detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        # A uint8 view gives the raw bytes of any dtype (bfloat16 has no numpy equivalent).
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return msgpack.ExtType(TENSOR_EXT, msgpack.packb([dtype, list(tensor.shape), raw]))
    if isinstance(obj, tuple):
        return list(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise ProtocolError(f"cannot encode a {type(obj).__name__} on the control channel")


def _decode_ext(code: int, data: bytes) -> Any:
    if code != TENSOR_EXT:
        raise ProtocolError(f"unknown msgpack ext type {code} on the control channel")
    import torch

    try:
        dtype_name, shape, raw = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ProtocolError(f"malformed tensor payload: {exc}") from exc
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype):
        raise ProtocolError(f"unknown tensor dtype {dtype_name!r:.80}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_TENSOR_DIMS
        or not all(type(size) is int and 0 <= size <= MAX_TENSOR_DIM for size in shape)
        or not isinstance(raw, bytes)
    ):
        # checked before multiplying: a product of 100,000 huge integers costs quadratic time
        raise ProtocolError(
            f"malformed tensor payload: the shape must be at most {MAX_TENSOR_DIMS} sizes in "
            f"0..{MAX_TENSOR_DIM} and the data bytes"
        )
    count = 1
    for size in shape:
        count *= int(size)
    expected = count * torch.empty((), dtype=dtype).element_size()
    if len(raw) != expected:
        raise ProtocolError(f"tensor {dtype_name}{list(shape)} needs {expected} bytes, got {len(raw)}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _torch_if_loaded() -> Any:
    # Only tensors that exist can be encoded, so torch is already imported whenever one is passed.
    import sys

    return sys.modules.get("torch")


def pack(obj: Any) -> bytes:
    """msgpack body of `obj`, tensors as ext types."""
    return msgpack.packb(obj, default=_encode_default, use_bin_type=True)


def unpack(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, ext_hook=_decode_ext, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed frame body: {exc}") from exc


def frame(obj: Any, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Header + body; raises FrameTooLarge instead of producing a frame the peer must refuse."""
    body = pack(obj)
    if len(body) > max_frame_bytes:
        raise FrameTooLarge(
            f"frame of {len(body)} bytes exceeds the control-channel limit of {max_frame_bytes} bytes "
            f"(raise {ENV_MAX_FRAME} / max_frame_bytes, or send less per command)"
        )
    return HEADER.pack(len(body)) + body


def check_length(length: int, max_frame_bytes: int) -> None:
    if length > max_frame_bytes:
        raise FrameTooLarge(
            f"peer announced a frame of {length} bytes, over the control-channel limit of "
            f"{max_frame_bytes} bytes"
        )


# ---------------------------------------------------------------------------------------------- messages

MESSAGE_TYPES: dict[str, type[Message]] = {}


def build(cls: type[T], values: dict[str, Any], what: str) -> T:
    """`cls(**values)` for a dataclass, or ProtocolError naming `what` and its unknown / missing fields."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    unknown = set(values) - {f.name for f in fields}
    if unknown:
        raise ProtocolError(f"{what} has unknown fields {sorted(unknown)}")
    missing = [
        f.name
        for f in fields
        if f.init
        and f.name not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ProtocolError(f"{what} is missing fields {missing}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{what} has an invalid field: {exc}") from exc


@dataclass
class Message:
    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            MESSAGE_TYPES[cls.kind] = cls

    def to_wire(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        body["kind"] = self.kind
        return body

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> Message:
        """The message from its decoded fields (`kind` removed); overridden where a field holds records."""
        return build(cls, values, f"message {cls.kind!r}")


@dataclass
class Record:
    """A typed value inside a message (a sample, one step's metrics), decoded with its fields checked."""

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_wire(cls: type[T], obj: Any) -> T:
        if not isinstance(obj, dict):
            raise ProtocolError(f"a {cls.__name__} must be a map, got {type(obj).__name__}")
        return build(cls, obj, f"record {cls.__name__!r}")


# Records: what both sides read field by field.


@dataclass
class WireSample(Record):
    """One sample as a rank trains on it: prompt + response `tokens`, the response being the last
    `response_length` of them; `loss_mask` and `rollout_log_probs` have one entry per response token."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    advantage: float = 0.0

    @classmethod
    def from_sample(cls, sample: Any) -> WireSample:
        """A `replay.sample.Sample` (anything with its training fields) → plain ints and floats, validated
        first when the sample can validate itself."""
        validate = getattr(sample, "validate", None)
        if validate is not None:
            validate()
        return cls(
            tokens=[int(token) for token in sample.tokens],
            response_length=int(sample.response_length),
            loss_mask=[int(value) for value in sample.loss_mask],
            rollout_log_probs=[float(value) for value in sample.rollout_log_probs],
            advantage=float(sample.advantage),
        )


@dataclass
class StepMetrics(Record):
    """One rank's raw numbers for one optimizer step (`TrainResult.steps`).

    The first eight are sums over this rank's tokens (the losses already divided by the step's loss tokens
    over all ranks), so the ranks' values add up; `logprob_abs_diff_max` is this rank's maximum; `grad_norm`
    and `lr` are the same on every rank (gradients are all-reduced before clipping); `step_time_s` is this
    rank's wall time. `coordinator.train.planning.reduce_step_metrics` combines them into a step's metrics.
    """

    loss: float
    pg_loss: float
    loss_tokens: float
    clipped_tokens: float
    entropy_sum: float
    kl_sum: float
    logprob_abs_diff_sum: float
    num_tokens: float
    logprob_abs_diff_max: float
    grad_norm: float
    lr: float
    step_time_s: float
    # With --use-tis: the sum of the TIS weights over loss tokens, and the tokens whose weight was clamped.
    tis_sum: float = 0.0
    tis_clipped_tokens: float = 0.0
    # Sums over loss tokens of the metrics a `--custom-tis-function-path` hook returned, by its names.
    extra: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                if not isinstance(value, dict) or not all(
                        isinstance(k, str) and not isinstance(v, bool) and isinstance(v, int | float)
                        for k, v in value.items()):
                    raise ValueError(f"StepMetrics.extra must map names to numbers, got {value!r:.100}")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"StepMetrics.{f.name} must be a number, got {value!r}")


@dataclass
class TrainResult(Record):
    """A rank's answer to `TrainCommand`: one `StepMetrics` per optimizer step, in order."""

    steps: list[StepMetrics]

    def to_wire(self) -> dict[str, Any]:
        return {"steps": [step.to_wire() for step in self.steps]}

    @classmethod
    def from_wire(cls, obj: Any) -> TrainResult:
        if not isinstance(obj, dict) or not isinstance(obj.get("steps"), list):
            raise ProtocolError(f"a TrainResult must be a map with a 'steps' list, got {obj!r:.200}")
        steps = [StepMetrics.from_wire(step) for step in obj["steps"]]
        return build(cls, {**obj, "steps": steps}, "record 'TrainResult'")


@dataclass
class Hello(Message):
    kind: ClassVar[str] = "hello"
    protocol_version: int
    token: str
    rank: int
    world_size: int
    local_rank: int
    pid: int
    restart_count: int = 0
    #: the node whose torchrun started this rank (0 on a single node)
    node_rank: int = 0


@dataclass
class Welcome(Message):
    kind: ClassVar[str] = "welcome"
    protocol_version: int = PROTOCOL_VERSION


@dataclass
class ErrorMessage(Message):
    kind: ClassVar[str] = "error"
    message: str


# Commands: the body of a Request. Each rank runs them in the order received.


@dataclass
class Command(Message):
    pass


@dataclass
class InitCommand(Command):
    kind: ClassVar[str] = "init"
    config: dict[str, Any]


@dataclass
class TrainCommand(Command):
    """One rollout's shard for this rank: `steps[i]` is this rank's part of optimizer step i.

    `step_loss_tokens[i]` is the number of loss-mask tokens of step i over *all* ranks, so every rank
    divides by the same count and the token mean spans the whole global batch. Answered by a `TrainResult`.
    """

    kind: ClassVar[str] = "train"
    rollout_id: int
    steps: list[list[WireSample]]
    step_loss_tokens: list[int]

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "rollout_id": self.rollout_id,
            "steps": [[sample.to_wire() for sample in step] for step in self.steps],
            "step_loss_tokens": self.step_loss_tokens,
        }

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> Message:
        steps = values.get("steps")
        if not isinstance(steps, list) or not all(isinstance(step, list) for step in steps):
            raise ProtocolError("message 'train' needs 'steps', a list of lists of samples")
        values = {**values, "steps": [[WireSample.from_wire(sample) for sample in step] for step in steps]}
        return build(cls, values, f"message {cls.kind!r}")


@dataclass
class SaveCommand(Command):
    kind: ClassVar[str] = "save"
    rollout_id: int
    directory: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadCommand(Command):
    kind: ClassVar[str] = "load"
    path: str


@dataclass
class ExportWeightsCommand(Command):
    kind: ClassVar[str] = "export_weights"
    directory: str
    weight_version: str
    keep: int = 2


@dataclass
class WeightManifestCommand(Command):
    """Answered with `buckets`: per bucket of at most `bucket_bytes`, the [name, dtype, shape] of each tensor
    in send order (parameter metadata only, no gather)."""

    kind: ClassVar[str] = "weight_manifest"
    bucket_bytes: int = 512 * 1024**2


@dataclass
class BroadcastWeightsCommand(Command):
    """Rank 0 joins the weight-update group (within `timeout_s`) and sends the manifest's buckets, one
    broadcast per bucket when `load_format` is "flattened_bucket", one per tensor otherwise."""

    kind: ClassVar[str] = "broadcast_weights"
    master_address: str
    master_port: int
    world_size: int
    group_name: str = "weight_update_group"
    timeout_s: float = 120.0
    backend: str = "gloo"
    bucket_bytes: int = 512 * 1024**2
    load_format: str = ""


@dataclass
class DestroyWeightGroupCommand(Command):
    kind: ClassVar[str] = "destroy_weight_group"
    group_name: str = "weight_update_group"


@dataclass
class OffloadCommand(Command):
    """Move the rank's training state (parameters, gradients, optimizer state, reference model) off the device
    until `onload` (colocation). `verify`: answer a digest of the state's bytes too (tests, benches)."""

    kind: ClassVar[str] = "offload"
    verify: bool = False


@dataclass
class OnloadCommand(Command):
    """Bring the state `offload` moved back, bit-identical; answered with the same figures as `offload`."""

    kind: ClassVar[str] = "onload"
    verify: bool = False


@dataclass
class ShutdownCommand(Command):
    kind: ClassVar[str] = "shutdown"


@dataclass
class Request(Message):
    kind: ClassVar[str] = "request"
    request_id: int
    command: Command

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "request_id": self.request_id, "command": self.command.to_wire()}

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> Message:
        command = decode_message(values.get("command"))
        if not isinstance(command, Command):
            raise ProtocolError(f"request carries a {command.kind!r}, which is not a command")
        return build(cls, {**values, "command": command}, f"message {cls.kind!r}")


@dataclass
class Response(Message):
    """The answer to one Request. `result` holds the command's results (metrics are dicts of floats)."""

    kind: ClassVar[str] = "response"
    request_id: int
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    traceback: str = ""


def encode_message(message: Message) -> dict[str, Any]:
    return message.to_wire()


def decode_message(obj: Any) -> Message:
    """Build the typed message from a decoded frame body; ProtocolError for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise ProtocolError(f"expected a message map with a 'kind', got {type(obj).__name__}")
    kind = obj["kind"]
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return cls.from_fields({key: value for key, value in obj.items() if key != "kind"})


_HELLO_INTS = {
    "protocol_version": (0, 1 << 31),
    "rank": (0, 1 << 31),
    "world_size": (1, 1 << 31),
    "local_rank": (0, 1 << 31),
    "pid": (0, 1 << 31),
    "restart_count": (0, 1 << 31),
    "node_rank": (0, 1 << 31),
}


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("a Hello holds no extension types")


def decode_hello(body: bytes) -> Hello:
    """The Hello of an unauthenticated peer, decoded strictly; ProtocolError for anything else.

    Its cost is bounded by the body's length (at most `MAX_HELLO_BYTES`): msgpack is told the largest
    lengths a Hello has, extension types are refused, and each field's type and range is checked before any
    other code sees it. A peer speaking another protocol version gets the version message, whatever else
    its Hello holds.
    """
    if len(body) > MAX_HELLO_BYTES:
        raise FrameTooLarge(f"a Hello of {len(body)} bytes is over the {MAX_HELLO_BYTES}-byte handshake limit")
    try:
        obj = msgpack.unpackb(
            body, raw=False, ext_hook=_no_ext, max_str_len=MAX_TOKEN_CHARS, max_bin_len=0, max_array_len=0,
            max_map_len=len(_HELLO_INTS) + 2, max_ext_len=0,
        )  # fmt: skip
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed Hello: {exc}"[:300]) from None
    if not isinstance(obj, dict) or obj.get("kind") != Hello.kind:
        kind = obj.get("kind") if isinstance(obj, dict) else type(obj).__name__
        raise ProtocolError(f"expected hello as the first message, got {kind!r:.40}")
    version = obj.get("protocol_version")
    if type(version) is int and version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version mismatch: rank speaks {version}, coordinator speaks {PROTOCOL_VERSION}; "
            "run the same rayless version on both sides"
        )
    values = {key: value for key, value in obj.items() if key != "kind"}
    for name, (low, high) in _HELLO_INTS.items():
        value = values.get(name, 0 if name in ("restart_count", "node_rank") else None)
        if type(value) is not int or not low <= value < high:
            raise ProtocolError(f"Hello field {name!r} must be an integer in {low}..{high - 1}, got {value!r:.40}")
    if type(values.get("token")) is not str:
        raise ProtocolError("Hello field 'token' must be a string")
    return build(Hello, values, "message 'hello'")


# ------------------------------------------------------------------------------------------ async side


async def send_message(stream: ByteStream, message: Message, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
    await stream.send(frame(encode_message(message), max_frame_bytes))


async def receive_message(
    stream: BufferedByteReceiveStream, max_frame_bytes: int = MAX_FRAME_BYTES
) -> Message:
    """Read one frame. Raises anyio.IncompleteRead / EndOfStream when the peer closed."""
    (length,) = HEADER.unpack(await stream.receive_exactly(HEADER.size))
    check_length(length, max_frame_bytes)
    return decode_message(unpack(await stream.receive_exactly(length)))


async def receive_hello(stream: BufferedByteReceiveStream) -> Hello:
    """Read an unauthenticated peer's first frame: at most `MAX_HELLO_BYTES`, decoded by `decode_hello`."""
    (length,) = HEADER.unpack(await stream.receive_exactly(HEADER.size))
    if length > MAX_HELLO_BYTES:
        raise FrameTooLarge(
            f"peer announced a first frame of {length} bytes; a Hello is at most {MAX_HELLO_BYTES} bytes"
        )
    return decode_hello(await stream.receive_exactly(length))


# ----------------------------------------------------------------------------------------- blocking side


class RankChannel:
    """The rank's end: one blocking socket to the coordinator, used by one thread."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes

    @classmethod
    def connect(
        cls,
        address: str,
        hello: Hello,
        *,
        timeout_s: float = 60.0,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> RankChannel:
        """Dial `host:port`, send Hello and wait for Welcome; HandshakeRefused with the coordinator's reason."""
        host, port = split_address(address)
        sock = socket.create_connection((host, port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = cls(sock, max_frame_bytes)
        try:
            channel.send(hello)
            reply = channel.receive()
        except ConnectionError as exc:
            sock.close()
            raise HandshakeRefused(
                f"coordinator at {address} closed the connection during the handshake"
            ) from exc
        except BaseException:
            sock.close()
            raise
        if isinstance(reply, ErrorMessage):
            sock.close()
            raise HandshakeRefused(f"coordinator at {address} refused rank {hello.rank}: {reply.message}")
        if not isinstance(reply, Welcome):
            sock.close()
            raise ProtocolError(f"expected welcome from the coordinator, got {reply.kind!r}")
        # Commands can take arbitrarily long (a training step); the channel itself has no deadline.
        sock.settimeout(None)
        return channel

    def send(self, message: Message) -> None:
        self.sock.sendall(frame(encode_message(message), self.max_frame_bytes))

    def receive(self) -> Message:
        (length,) = HEADER.unpack(self._receive_exactly(HEADER.size))
        check_length(length, self.max_frame_bytes)
        return decode_message(unpack(self._receive_exactly(length)))

    def _receive_exactly(self, count: int) -> bytes:
        buffer = bytearray(count)
        view = memoryview(buffer)
        received = 0
        while received < count:
            chunk = self.sock.recv_into(view[received:], count - received)
            if chunk == 0:
                raise ConnectionError("the coordinator closed the control channel")
            received += chunk
        return bytes(buffer)

    def close(self) -> None:
        self.sock.close()


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"control address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def max_frame_bytes_from_env() -> int:
    value = os.environ.get(ENV_MAX_FRAME)
    if not value:
        return MAX_FRAME_BYTES
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{ENV_MAX_FRAME}={value!r} is not a positive integer")
    return int(value)
