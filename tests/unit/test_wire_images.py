"""A train command carries each distinct image set once (`TrainCommand.images`), a rank gets every sample's pixels
back bit-identical and without a copy of the frame, and a command over the frame limit is refused naming its
sizes and what to change (issue 33)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.train.commands import command_sizes
from workers import protocol
from workers.protocol.control import wire_images
from workers.protocol.frames import HEADER

PATCHES, FEATURES = 64, 1176  # 1176: Qwen2-VL's patch features (3 channels x 2 frames x 14 x 14)


def sample(images: dict[str, torch.Tensor] | None, tokens: int = 6) -> protocol.WireSample:
    return protocol.WireSample(tokens=list(range(1, tokens + 1)), response_length=2, loss_mask=[1, 1],
                               rollout_log_probs=[-1.0, -1.0], images=wire_images(images))


def inputs(seed: int, patches: int = PATCHES) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    side = int(patches**0.5)
    return {"pixel_values": torch.rand(patches, FEATURES, generator=generator),
            "image_grid_thw": torch.tensor([[1, side, side]])}


def through_the_wire(command: protocol.TrainCommand, limit: int = protocol.MAX_FRAME_BYTES
                     ) -> tuple[protocol.TrainCommand, bytearray]:
    frame = protocol.encode_frame(protocol.Request(1, command), limit)
    body = bytearray(frame[HEADER.size:])  # as the rank's channel reads it: one buffer, decoded in place
    decoded = protocol.decode_body(body)
    assert isinstance(decoded, protocol.Request) and isinstance(decoded.command, protocol.TrainCommand)
    return decoded.command, body


def test_a_groups_samples_send_their_prompts_image_once_and_get_it_back_bit_identical() -> None:
    group = inputs(0)  # the 8 samples of one prompt share its processor outputs, as the rollout leaves them
    copy = {key: value.clone() for key, value in group.items()}  # a hook's (or a dump's) equal pixels, own tensor
    other = inputs(1)
    samples = [sample(group) for _ in range(8)] + [sample(copy), sample(other), sample(None)]
    expected = [None if s.images is None else bytes(s.images.pixel_values) for s in samples]
    command = protocol.TrainCommand(0, [samples[:5], samples[5:]], [10, 12])

    assert len(command.images) == 2  # the shared tensor and its equal copy: one entry; the other image: one
    assert [s.image_ref for s in samples] == [0] * 9 + [1, -1]
    assert all(s.images is None for s in samples)  # nothing inline: the table holds the pixels
    one_image = PATCHES * FEATURES * 4
    assert command.image_bytes() == 2 * one_image

    decoded, body = through_the_wire(command)
    frame_bytes = len(body)
    assert 2 * one_image < frame_bytes < 2 * one_image + 4096  # two images' pixels, not eleven
    decoded.attach_images()
    received = [s for step in decoded.steps for s in step]
    for wire, want in zip(received, expected, strict=True):
        if want is None:
            assert wire.images is None and wire.image_ref == -1
            continue
        assert wire.images is not None and wire.images.problem() is None
        assert bytes(wire.images.pixel_values) == want  # bit-identical float32 pixels
        assert wire.images.pixel_values.obj is body  # a view of the frame's buffer: decoded without a copy
    assert received[0].images is received[8].images  # one object per distinct image on the rank too
    assert np.array_equal(np.frombuffer(received[9].images.pixel_values, dtype="<f4").reshape(PATCHES, FEATURES),
                          other["pixel_values"].numpy())


def test_images_of_the_same_shape_but_other_pixels_are_not_merged() -> None:
    first, second = inputs(0), inputs(0)
    second["pixel_values"][-1, -1] += 1.0  # one value of the last patch differs
    command = protocol.TrainCommand(0, [[sample(first), sample(second), sample(first)]], [6])
    assert len(command.images) == 2 and [s.image_ref for s in command.steps[0]] == [0, 1, 0]


def test_an_image_ref_outside_the_table_is_refused_naming_the_sample() -> None:
    command = protocol.TrainCommand(0, [[sample(inputs(0)), sample(None)]], [4])
    command.steps[0][1].image_ref = 3  # a peer's malformed reference
    decoded, _ = through_the_wire(command)
    with pytest.raises(ValueError, match=r"step 0 sample 1: image_ref 3 outside the command's 1 image set"):
        decoded.attach_images()


def test_a_command_over_the_frame_limit_is_refused_naming_its_sizes_and_what_to_change() -> None:
    samples = [sample(inputs(seed)) for seed in range(4) for _ in range(8)]  # 4 prompts x 8 samples
    command = protocol.TrainCommand(7, [samples], [64])
    limit = 3 * PATCHES * FEATURES * 4  # room for three of the four images
    with pytest.raises(protocol.FrameTooLarge, match="exceeds the control-channel limit"):
        protocol.encode_frame(protocol.Request(1, command), limit)
    text = command_sizes({0: command})
    assert "rank 0: 32 samples, 192 tokens, 4 distinct image set(s) for 32 samples = 1.1 MiB" in text
    assert protocol.ENV_MAX_FRAME in text and "--rollout-batch-size" in text and "max_pixels" in text
    through_the_wire(command, 4 * PATCHES * FEATURES * 4 + 8192)  # deduplicated, it fits four images' room


def test_the_coordinators_train_refuses_an_oversized_command_naming_the_rollout_and_its_images() -> None:
    """`TrainCommands.train` over a stand-in for the rank connections (a fake, named so: a real over-limit frame
    is refused before any rank is involved) that encodes the frames as `ControlServer.call` does first."""
    import anyio

    from coordinator.train.calls import encode_frames
    from coordinator.train.commands import TrainCommands
    from replay.sample import Sample
    from tests.support.train_settings import init_command

    limit = 3 * PATCHES * FEATURES * 4

    class EncodingOnlyServer:  # the fake: ControlServer.call's encoding step, then nothing is sent
        world_size, ranks = 1, {}

        async def call(self, commands: dict[int, protocol.Command]) -> dict[int, protocol.Reply]:
            await encode_frames({rank: protocol.Request(1, c) for rank, c in commands.items()}, limit)
            raise AssertionError("encoded a frame over the limit")

    rollout = []
    for seed in range(4):
        images = inputs(seed)
        for _ in range(8):
            rollout.append(Sample(tokens=[1, 2, 3, 4, 5, 6], response_length=2, loss_mask=[1, 1],
                                  rollout_log_probs=[-1.0, -1.0], multimodal_train_inputs=images))
    trainer = TrainCommands(EncodingOnlyServer())  # type: ignore[arg-type]
    trainer.settings = init_command({"model_path": "unused"}).settings

    async def main() -> None:
        with pytest.raises(protocol.FrameTooLarge) as refused:
            await trainer.train(5, rollout)
        message = str(refused.value)
        assert message.startswith("rollout 5: frame of ") and f"limit of {limit} bytes" in message
        assert "32 samples, 192 tokens, 4 distinct image set(s) for 32 samples = 1.1 MiB" in message
        assert protocol.ENV_MAX_FRAME in message

    anyio.run(main)


def test_the_coordinator_reads_the_frame_limit_its_error_names_and_hands_it_to_its_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from coordinator.train.group import TrainGroup
    from coordinator.train.torchrun import TorchrunSpec

    monkeypatch.setenv(protocol.ENV_MAX_FRAME, str(512 * 2**20))
    group = TrainGroup(TorchrunSpec(nproc_per_node=1), run_dir=tmp_path, launch=False)
    assert group.max_frame_bytes == 512 * 2**20 and group.server.max_frame_bytes == 512 * 2**20
    monkeypatch.delenv(protocol.ENV_MAX_FRAME)
    assert TrainGroup(TorchrunSpec(nproc_per_node=1), run_dir=tmp_path, launch=False).max_frame_bytes \
        == protocol.MAX_FRAME_BYTES


def test_a_rollouts_commands_digest_each_distinct_buffer_once_not_once_per_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`TrainCommands.train` for 4 ranks over a stand-in for the rank connections (a fake, named so: it records
    the commands and encodes their frames as `ControlServer.call` does first, then stops the step). The digests
    are counted by wrapping the real BLAKE2b the image table calls."""
    import hashlib
    from types import SimpleNamespace

    import anyio

    from coordinator.train.calls import encode_frames
    from coordinator.train.commands import TrainCommands
    from replay.sample import Sample
    from tests.support.train_settings import init_command
    from workers.protocol import control

    digests = 0

    def counted_blake2b(data: memoryview, digest_size: int) -> object:
        nonlocal digests
        digests += 1
        return hashlib.blake2b(data, digest_size=digest_size)

    monkeypatch.setattr(control, "hashlib", SimpleNamespace(blake2b=counted_blake2b))
    prompts = [inputs(seed) for seed in range(4)]
    prompts.append({key: value.clone() for key, value in prompts[0].items()})  # equal pixels, its own buffer
    rollout = [Sample(tokens=list(range(1, 7 + index % 5)), response_length=2, loss_mask=[1, 1],
                      rollout_log_probs=[-1.0, -1.0], multimodal_train_inputs=images)
               for images in prompts for index in range(8)]
    sent: dict[int, protocol.TrainCommand] = {}
    frames: dict[int, bytes] = {}

    class Stopped(Exception):
        pass

    class RecordingServer:  # the fake: ControlServer.call's encoding step, then nothing is sent
        world_size, ranks = 4, {}

        async def call(self, commands: dict[int, protocol.Command]) -> dict[int, protocol.Reply]:
            requests = {rank: protocol.Request(1, command) for rank, command in commands.items()}
            for rank, (_, frame) in (await encode_frames(requests, protocol.MAX_FRAME_BYTES)).items():
                frames[rank] = b"".join(frame) if isinstance(frame, list) else bytes(frame)
            sent.update(commands)  # type: ignore[arg-type]
            raise Stopped

    trainer = TrainCommands(RecordingServer())  # type: ignore[arg-type]
    trainer.settings = init_command({"model_path": "unused"}).settings
    with pytest.raises(Stopped):
        anyio.run(trainer.train, 3, rollout)

    assert sorted(sent) == [0, 1, 2, 3]
    per_rank = [len(command.images) for command in sent.values()]
    assert sum(per_rank) > 5  # the prompts' samples are spread over the ranks: per-rank digests would be more
    assert digests == 5  # one per distinct buffer in the whole rollout (4 prompts + the equal copy's own)
    wanted = {images["pixel_values"].numpy().tobytes() for images in prompts}
    for command in sent.values():
        tables = [bytes(images.pixel_values) for images in command.images]
        assert len(tables) == len(set(tables)) and set(tables) <= wanted  # one copy per distinct image

    # The frames are bit-identical to those of commands whose tables digest every buffer themselves.
    from coordinator.train.planning import plan_steps

    monkeypatch.undo()
    plan = plan_steps([protocol.WireSample.from_sample(s) for s in rollout], trainer.settings.batching, 4)
    for rank in range(4):
        alone = protocol.TrainCommand(3, [step.shards[rank] for step in plan], [step.loss_tokens for step in plan])
        assert protocol.encode_frame(protocol.Request(1, alone), protocol.MAX_FRAME_BYTES) == frames[rank]
