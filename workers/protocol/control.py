"""The control channel's messages: what the coordinator (`coordinator.train`) and a rank (`workers.train_rank`)
say to each other, declared once for both sides.

Owns `PROTOCOL_VERSION`, the sample record a rank trains on (`WireSample`), the handshake (Hello → Welcome /
ErrorMessage), the commands (each naming its reply record, declared in `workers.protocol.replies`), `Request` /
`Response`, and `CONTROL`, their family in the one message layer (`workers.protocol.messages`). The contract
in prose: docs/architecture.md#contracts.

Invariant: changing what a message or a reply carries changes `PROTOCOL_VERSION` (both ends are one checkout;
the handshake compares it). Adding a field is adding a line to its declaration; a field without a default is
required on the wire.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import msgspec

from workers.protocol import codec
from workers.protocol.arrays import Kind, PackedArray, PackedArrayError, pack_ahead
from workers.protocol.frames import framed
from workers.protocol.messages import Family, Int31, Message, Record, Token, union_of
from workers.protocol.replies import (
    AnyReply,
    BroadcastWeightsReply,
    DestroyWeightGroupReply,
    ExportWeightsReply,
    ForwardBackwardReply,
    InitReply,
    LoadReply,
    OffloadReply,
    OnloadReply,
    OptimStepReply,
    PublishReply,
    Reply,
    SaveHfReply,
    SaveReply,
    ShutdownReply,
    TrainResult,
    WeightManifestReply,
)
from workers.protocol.scatter import Part, encode_parts
from workers.protocol.train_settings import TrainSettings

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from anyio.abc import ByteStream
    from anyio.streams.buffered import BufferedByteReceiveStream

    from replay.sample import Sample

# 3: StepMetrics.extra (hook metrics); 4: offload / onload (colocation); 5: Hello.node_rank;
# 6: WireSample.teacher_log_probs and TrainSettings.opd (on-policy distillation); 7: SaveHfCommand (--save-hf);
# 8: SaveCommand.publish and PublishCommand (a checkpoint published after its metrics row);
# 9: BatchingSettings.dynamic_global_batch_size; 10: WireSample.opd_reverse_kl and OpdSettings.top_k (top-k OPD);
# 11: TrainSettings.returns and .critic (PPO's value model); 12: Response.result one typed reply per command
# (`replies`); 13: ExportWeightsCommand.delta_encoding / .delta_base_version and ExportWeightsReply.delta / .changed
# (slime's delta weight updates); 14: WireSample's per-token fields as packed arrays (`arrays`: int32 / uint8 /
# float64 buffers as msgpack extensions, not one msgpack value per token); 15: ForwardBackwardCommand,
# OptimStepCommand and LoadCommand.weights_only (the Tinker service); 16: WireSample.images (a vision-language
# sample's processed images); 17: TrainCommand.images, one copy of each distinct image per command, and
# WireSample.image_ref (the samples of a group no longer carry their prompt's pixels each)
PROTOCOL_VERSION = 17
MAX_FRAME_BYTES = 256 * 1024 * 1024

ENV_TOKEN = "RAYLESS_CONTROL_TOKEN"
ENV_ADDR = "RAYLESS_CONTROL_ADDR"
ENV_MAX_FRAME = "RAYLESS_CONTROL_MAX_FRAME_BYTES"
#: the node (of a multi-node run) whose torchrun started the rank; reported in Hello
ENV_NODE_RANK = "RAYLESS_NODE_RANK"

LIMIT_HINT = f" (raise {ENV_MAX_FRAME} / max_frame_bytes, or send less per command)"


class ControlMessage(Message):
    """The base of the control channel's kinds."""


# Records: what both sides read field by field.


class WireImages(Record, dict=True):
    """A vision-language sample's images as its vision tower takes them (the processor's outputs): `pixel_values`
    float32 little-endian bytes of shape `pixel_shape` [patches, patch features], and each image's (t, h, w)
    patch grid, whose products sum to the patches. Bounded by the frame; `problem` checks the rest.

    `pixel_values` is a memoryview: the coordinator's is a view of the processor's tensor (no copy per sample),
    a rank's a view into the frame it decoded (no copy either). `dict=True` only so that `content_key` can keep
    its digest on the object (never encoded): `share_images` makes the samples of one buffer share one object,
    so a rollout's commands digest each distinct buffer once, not once per rank."""

    pixel_values: memoryview
    pixel_shape: list[int]
    image_grid_thw: list[list[int]]

    def problem(self) -> str | None:
        """Why these images are malformed, or None."""
        if len(self.pixel_shape) != 2 or min(self.pixel_shape, default=0) < 1:
            return f"pixel_shape {self.pixel_shape} must be [patches, features], both positive"
        patches, features = self.pixel_shape
        if memoryview(self.pixel_values).nbytes != 4 * patches * features:
            return (f"pixel_values holds {memoryview(self.pixel_values).nbytes} bytes for float32 "
                    f"{self.pixel_shape}")
        if not self.image_grid_thw or any(len(grid) != 3 or min(grid) < 1 for grid in self.image_grid_thw):
            return f"image_grid_thw {self.image_grid_thw} must hold one positive (t, h, w) per image"
        if sum(t * h * w for t, h, w in self.image_grid_thw) != patches:
            return f"image_grid_thw {self.image_grid_thw} does not add up to the {patches} patches"
        return None

    @property
    def nbytes(self) -> int:
        return memoryview(self.pixel_values).nbytes

    def buffer_key(self) -> tuple[object, ...]:
        """Where the pixels lie (address, size) and their shape: equal keys are the same images now (a group's
        samples share their prompt's tensor)."""
        import numpy

        address = numpy.frombuffer(memoryview(self.pixel_values).cast("B"), dtype=numpy.uint8).ctypes.data
        return (address, self.nbytes, *self.content_shape())

    def content_key(self) -> tuple[object, ...]:
        """A 128-bit BLAKE2b digest of the pixel bytes with the shape and grids: equal keys, equal images. Kept
        on the object with the buffer it digested: asked again for the same buffer, it is not hashed again."""
        where = self.buffer_key()
        kept = self.__dict__.get("_content_key")
        if kept is not None and kept[0] == where:
            return kept[1]
        digest = hashlib.blake2b(memoryview(self.pixel_values).cast("B"), digest_size=16).digest()
        key = (digest, *self.content_shape())
        self.__dict__["_content_key"] = (where, key)
        return key

    def content_shape(self) -> tuple[object, ...]:
        return (tuple(self.pixel_shape), tuple(map(tuple, self.image_grid_thw)))


class WireSample(Record):
    """One sample as a rank trains on it: prompt + response `tokens`, the response being the last
    `response_length` of them; `loss_mask` and `rollout_log_probs` have one entry per response token.

    The per-token fields are `PackedArray`s (`workers.protocol.arrays`: int32 tokens, uint8 mask, float64
    logprobs on the wire, one buffer each); built from lists (or a hook's numpy arrays / tensors) they keep a
    reference and are packed as the frame is written. They read like the lists they replace."""

    tokens: PackedArray
    response_length: int
    loss_mask: PackedArray
    rollout_log_probs: PackedArray
    advantage: float = 0.0
    #: on-policy distillation's teacher logprob of each response token (None: not distilled, or computed by
    #: the rank's own teacher)
    teacher_log_probs: PackedArray | None = None
    #: miles' top-k on-policy distillation: the weighted reverse KL of each response token, computed during the
    #: rollout (None: not top-k OPD)
    opd_reverse_kl: PackedArray | None = None
    #: a vision-language sample's images (tokens hold their expanded placeholders); None: text only, or (on the
    #: wire) carried once in its TrainCommand's `images` table at `image_ref`
    images: WireImages | None = None
    #: the index of this sample's images in its TrainCommand's table; -1: none there
    image_ref: int = -1

    def __post_init__(self) -> None:
        # Runs when built and when decoded: lists become arrays (by reference), and every per-response-token
        # array has one entry per response token (lengths are O(1): no value is read here). That the response
        # leaves a prompt token is the rank's check (`train_rank.batching.check_sample`), as before.
        self.tokens = PackedArray.of(Kind.TOKENS, self.tokens)
        self.loss_mask = PackedArray.of(Kind.MASK, self.loss_mask)
        self.rollout_log_probs = PackedArray.of(Kind.FLOATS, self.rollout_log_probs)
        if self.teacher_log_probs is not None:
            self.teacher_log_probs = PackedArray.of(Kind.FLOATS, self.teacher_log_probs)
        if self.opd_reverse_kl is not None:
            self.opd_reverse_kl = PackedArray.of(Kind.FLOATS, self.opd_reverse_kl)
        for name in ("loss_mask", "rollout_log_probs", "teacher_log_probs", "opd_reverse_kl"):
            values = getattr(self, name)
            if values is not None and len(values) != self.response_length:
                raise PackedArrayError(f"{name} has {len(values)} entries, response_length is "
                                       f"{self.response_length}")

    @classmethod
    def from_sample(cls, sample: Sample) -> WireSample:
        """A `replay.sample.Sample`, validated, as a wire sample: its lists (or a hook's numpy / torch values in
        them) by reference, packed into int32 / uint8 / float64 buffers when the frame is written — a copy by
        `array` in C for plain ints and floats, the per-value `int()` / `float()` path for anything else."""
        sample.validate()
        return cls(
            tokens=PackedArray.of(Kind.TOKENS, sample.tokens),
            response_length=int(sample.response_length),
            loss_mask=PackedArray.of(Kind.MASK, sample.loss_mask),
            rollout_log_probs=PackedArray.of(Kind.FLOATS, sample.rollout_log_probs),
            advantage=float(sample.advantage),
            teacher_log_probs=_optional(sample.teacher_log_probs),
            opd_reverse_kl=_optional(sample.opd_reverse_kl),
            images=wire_images(sample.multimodal_train_inputs),
        )


#: the shortest sample (prompt + response tokens) `pack_sample_ahead` packs
PACK_AHEAD_MIN_TOKENS = 512


def pack_sample_ahead(sample: Sample) -> None:
    """Pack `sample`'s per-token lists now, as `from_sample` will send them: each list is replaced by a
    `PackedList` of the same values holding its int32 / uint8 / float64 bytes, so the hand-off reads no value
    again. For a group accepted during the rollout (engine-bound time); a hook that changes a list afterwards
    (any in-place list method, or a new list) drops those bytes and the hand-off packs that list as before.
    A sample under `PACK_AHEAD_MIN_TOKENS` is left as it is: packing costs a few µs per array before any value
    is read, which would add to every short sample's rollout CPU to save the hand-off next to nothing."""
    if len(sample.tokens) < PACK_AHEAD_MIN_TOKENS:
        return
    sample.tokens = pack_ahead(Kind.TOKENS, sample.tokens)  # type: ignore[assignment]
    sample.loss_mask = pack_ahead(Kind.MASK, sample.loss_mask)  # type: ignore[assignment]
    sample.rollout_log_probs = pack_ahead(Kind.FLOATS, sample.rollout_log_probs)  # type: ignore[assignment]
    sample.teacher_log_probs = pack_ahead(Kind.FLOATS, sample.teacher_log_probs)  # type: ignore[assignment]
    sample.opd_reverse_kl = pack_ahead(Kind.FLOATS, sample.opd_reverse_kl)  # type: ignore[assignment]


def _optional(values: object) -> PackedArray | None:
    """A list (or a hook's tensor, as slime's OPD post-process leaves) as float64 values; None stays None."""
    return None if values is None else PackedArray.of(Kind.FLOATS, values)


def share_images(samples: Iterable[WireSample]) -> None:
    """Give the samples whose images lie in the same buffer one `WireImages` object (the first's), in one pass
    over the whole rollout before it is split into ranks: each rank's `TrainCommand` then finds the digest
    that object keeps, so each distinct buffer is digested once per rollout, not once per rank that trains on
    it. The pixels are not copied or changed, only which object refers to them."""
    first: dict[tuple[object, ...], WireImages] = {}
    for sample in samples:
        if sample.images is not None:
            sample.images = first.setdefault(sample.images.buffer_key(), sample.images)


def wire_images(inputs: Mapping[str, object] | None) -> WireImages | None:
    """slime's `multimodal_train_inputs` (`pixel_values`, `image_grid_thw`: tensors or arrays) as WireImages."""
    if not inputs:
        return None
    pixels, grid = inputs.get("pixel_values"), inputs.get("image_grid_thw")
    to_numpy = getattr(pixels, "numpy", None)
    array = to_numpy() if callable(to_numpy) else pixels
    import numpy

    values = numpy.ascontiguousarray(numpy.asarray(array, dtype="<f4"))  # a view of a float32 tensor, no copy
    shape = inputs.get("pixel_shape")  # a dump's: flat float64 values and their [patches, features]
    if isinstance(shape, list):
        values = values.reshape([int(n) for n in shape])
    rows = grid.tolist() if hasattr(grid, "tolist") else grid
    pixel_bytes = memoryview(values.reshape(-1)).cast("B")
    images = WireImages(pixel_values=pixel_bytes, pixel_shape=[int(n) for n in values.shape],
                        image_grid_thw=[[int(v) for v in row] for row in rows])  # type: ignore[union-attr]
    problem = images.problem()
    if problem is not None:
        raise ValueError(f"multimodal_train_inputs: {problem}")
    return images


# The handshake.


class Hello(ControlMessage, tag="hello"):
    protocol_version: Int31
    token: Token
    rank: Int31
    world_size: Annotated[int, msgspec.Meta(ge=1, lt=1 << 31)]
    local_rank: Int31
    pid: Int31
    restart_count: Int31 = 0
    #: the node whose torchrun started this rank (0 on a single node)
    node_rank: Int31 = 0


class Welcome(ControlMessage, tag="welcome"):
    protocol_version: int = PROTOCOL_VERSION


class ErrorMessage(ControlMessage, tag="error"):
    message: str


# Commands: the body of a Request. Each rank runs them in the order received.


class Command(ControlMessage):
    """The base of the commands (abstract: no `tag`). `reply`: the record every rank answers it with."""

    reply: ClassVar[type[Reply]]


class InitCommand(Command, tag="init"):
    """The trainer's settings, by component, in the same types on both ends."""

    reply: ClassVar[type[Reply]] = InitReply
    settings: TrainSettings


class TrainCommand(Command, tag="train"):
    """One rollout's shard for this rank: `steps[i]` is this rank's part of optimizer step i.

    `step_loss_tokens[i]` is the number of loss-mask tokens of step i over *all* ranks, so every rank
    divides by the same count and the token mean spans the whole global batch. Answered by a `TrainResult`.

    `images`: each distinct image set of the samples once (the `--n-samples-per-prompt` samples of a prompt
    share their prompt's); a sample names its entry by `image_ref`. Built with samples carrying `images`, the
    command moves them into the table (`__post_init__`: the sample's `images` become None, its `image_ref` the
    entry, whatever it was); the rank gives them back with `attach_images`.
    """

    reply: ClassVar[type[Reply]] = TrainResult
    rollout_id: int
    steps: list[list[WireSample]]
    step_loss_tokens: list[int]
    images: list[WireImages] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        # One entry per distinct image set: a buffer already seen is found by its address (no hashing: the
        # samples of a group share their prompt's tensor), another by a digest of its bytes (once per buffer; kept
        # on the WireImages object, which share_images makes one per buffer across a rollout's commands).
        by_buffer: dict[tuple[object, ...], int] = {}
        by_content = {images.content_key(): index for index, images in enumerate(self.images)}
        for samples in self.steps:
            for sample in samples:
                if sample.images is None:  # text, or already in the table
                    continue
                where = sample.images.buffer_key()
                found = by_buffer.get(where)
                if found is None:
                    found = by_content.setdefault(sample.images.content_key(), len(self.images))
                    if found == len(self.images):
                        self.images.append(sample.images)
                    by_buffer[where] = found
                sample.images, sample.image_ref = None, found

    def image_bytes(self) -> int:
        """The pixel bytes the command carries (each distinct image once)."""
        return sum(images.nbytes for images in self.images)

    def attach_images(self) -> None:
        """Give each sample its images from the table (the rank, before training); an `image_ref` outside the
        table is refused naming the sample."""
        for step, samples in enumerate(self.steps):
            for index, sample in enumerate(samples):
                if sample.image_ref == -1:
                    continue
                if not 0 <= sample.image_ref < len(self.images):
                    raise ValueError(f"step {step} sample {index}: image_ref {sample.image_ref} outside the "
                                     f"command's {len(self.images)} image set(s)")
                sample.images = self.images[sample.image_ref]


class SaveCommand(Command, tag="save"):
    """Write a complete checkpoint; `publish`: make it the one `latest` names at once. Without, it waits in
    `tmp-<id>` for a `PublishCommand`: the coordinator publishes once its metrics row is written."""

    reply: ClassVar[type[Reply]] = SaveReply
    rollout_id: int
    directory: str
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    publish: bool = True


class PublishCommand(Command, tag="publish"):
    """Rank 0 publishes the complete `tmp-<id>` a `SaveCommand(publish=False)` wrote (the others answer)."""

    reply: ClassVar[type[Reply]] = PublishReply
    rollout_id: int
    directory: str


class LoadCommand(Command, tag="load"):
    """Restore a checkpoint; `weights_only`: the optimizer starts afresh (the Tinker service's weights-only
    load) instead of taking the checkpoint's state."""

    reply: ClassVar[type[Reply]] = LoadReply
    path: str
    weights_only: bool = False


class ExportWeightsCommand(Command, tag="export_weights"):
    """A full snapshot, or with `delta_encoding` (`--update-weight-mode delta`) the changed tensors against rank
    0's copy of `delta_base_version`'s weights (a full snapshot when it holds no copy of that version). Either
    way rank 0 then keeps a CPU copy of these weights as the next delta's base."""

    reply: ClassVar[type[Reply]] = ExportWeightsReply
    directory: str
    weight_version: str
    keep: int = 2
    delta_encoding: str = ""
    delta_base_version: str = ""


class SaveHfCommand(Command, tag="save_hf"):
    """Write the model as a Hugging Face directory at `directory` (`--save-hf`), replacing one there; answered
    with its `path`. LoRA: the merged weights, and the adapter in the PEFT format in `adapter/`."""

    reply: ClassVar[type[Reply]] = SaveHfReply
    directory: str


class WeightManifestCommand(Command, tag="weight_manifest"):
    """Answered with `buckets`: per bucket of at most `bucket_bytes`, the [name, dtype, shape] of each tensor
    in send order (parameter metadata only, no gather)."""

    reply: ClassVar[type[Reply]] = WeightManifestReply
    bucket_bytes: int = 512 * 1024**2


class BroadcastWeightsCommand(Command, tag="broadcast_weights"):
    """Rank 0 joins the weight-update group (within `timeout_s`) and sends the manifest's buckets, one
    broadcast per bucket when `load_format` is "flattened_bucket", one per tensor otherwise."""

    reply: ClassVar[type[Reply]] = BroadcastWeightsReply
    master_address: str
    master_port: int
    world_size: int
    group_name: str = "weight_update_group"
    timeout_s: float = 120.0
    backend: str = "gloo"
    bucket_bytes: int = 512 * 1024**2
    load_format: str = ""


class DestroyWeightGroupCommand(Command, tag="destroy_weight_group"):
    reply: ClassVar[type[Reply]] = DestroyWeightGroupReply
    group_name: str = "weight_update_group"


class OffloadCommand(Command, tag="offload"):
    """Move the rank's training state (parameters, gradients, optimizer state, reference model) off the device
    until `onload` (colocation). `verify`: answer a digest of the state's bytes too (tests, benches)."""

    reply: ClassVar[type[Reply]] = OffloadReply
    verify: bool = False


class OnloadCommand(Command, tag="onload"):
    """Bring the state `offload` moved back, bit-identical; answered with the same figures as `offload`."""

    reply: ClassVar[type[Reply]] = OnloadReply
    verify: bool = False


class ShutdownCommand(Command, tag="shutdown"):
    reply: ClassVar[type[Reply]] = ShutdownReply


class TinkerDatum(Record):
    """One Tinker `Datum` as the ranks take it: position i of `tokens` predicts `target_tokens[i]`; the
    per-position inputs its loss needs (`weights` for cross_entropy; the sampler's `logprobs` and `advantages`
    for the policy-gradient losses), empty when the loss takes none."""

    tokens: list[int]
    target_tokens: list[int]
    weights: list[float] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)
    advantages: list[float] = msgspec.field(default_factory=list)


class ForwardBackwardCommand(Command, tag="forward_backward"):
    """The Tinker service's `forward_backward` (or `forward` with `forward_only`) on this rank's share of the
    data: the loss `loss_fn` (a sum over positions, as Tinker's) with `loss_config`; gradients accumulate until
    an `OptimStepCommand`."""

    reply: ClassVar[type[Reply]] = ForwardBackwardReply
    data: list[TinkerDatum]
    loss_fn: str
    loss_config: dict[str, float] = msgspec.field(default_factory=dict)
    forward_only: bool = False


class OptimStepCommand(Command, tag="optim_step"):
    """One Adam step on the accumulated gradients (summed over ranks) with these parameters, then the gradients
    are cleared. `grad_clip_norm` 0: no clipping."""

    reply: ClassVar[type[Reply]] = OptimStepReply
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


#: any kind of command (built from the declarations above: a new Command subclass with a tag is one)
AnyCommand = union_of(Command)


class Request(ControlMessage, tag="request"):
    request_id: int
    command: AnyCommand


class Response(ControlMessage, tag="response"):
    """The answer to one Request: `ok` with the command's reply record in `result` (its `kind` the command's),
    or not `ok` with the rank's `error` and `traceback` and no result."""

    request_id: int
    ok: bool
    result: AnyReply | None = None
    error: str = ""
    traceback: str = ""


CONTROL = Family(
    "control channel", ControlMessage, hello=Hello, version=PROTOCOL_VERSION, version_field="protocol_version",
    peer="rank", us="coordinator", max_frame_bytes=MAX_FRAME_BYTES, enc_hook=codec.encode_hook,
    ext_hook=codec.ext_hook, limit_hint=LIMIT_HINT,
)  # fmt: skip


# ------------------------------------------------------------------------------------- the family's functions


def encode_frame(message: ControlMessage, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytearray:
    """The message's frame; FrameTooLarge instead of a frame the peer must refuse."""
    return CONTROL.encode(message, max_frame_bytes)


def encode_frame_parts(message: ControlMessage, max_frame_bytes: int = MAX_FRAME_BYTES) -> list[Part]:
    """The message's frame as parts to send in order, each large per-token array left where it lies
    (`workers.protocol.scatter`): joined, exactly `encode_frame`'s bytes."""
    return encode_parts(CONTROL, message, max_frame_bytes, codec.encode_hook)


def decode_body(body: bytes) -> Message:
    """A frame's body after the handshake → its typed message; ProtocolError for anything else."""
    return CONTROL.decode(body)


def decode_message(obj: Any) -> Message:
    """A message from plain values (an unpacked body); ProtocolError for anything else."""
    return CONTROL.convert(obj)


def decode_hello(body: bytes) -> Hello:
    """The Hello of an unauthenticated peer (at most `MAX_HELLO_BYTES`), decoded strictly and bounded."""
    return CONTROL.decode_hello(body)  # type: ignore[return-value]


def frame(obj: Any, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Header + body of any plain value; FrameTooLarge over the limit."""
    return framed(codec.pack(obj), max_frame_bytes, "control-channel", LIMIT_HINT)


async def send_message(stream: ByteStream, message: ControlMessage, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
    await CONTROL.send(stream, message, max_frame_bytes)


async def receive_message(stream: BufferedByteReceiveStream, max_frame_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Read one frame. Raises anyio.IncompleteRead / EndOfStream when the peer closed."""
    return await CONTROL.receive(stream, max_frame_bytes)


async def receive_hello(stream: BufferedByteReceiveStream) -> Hello:
    """Read an unauthenticated peer's first frame: at most `MAX_HELLO_BYTES`, decoded by `decode_hello`."""
    return await CONTROL.receive_hello(stream)  # type: ignore[return-value]
