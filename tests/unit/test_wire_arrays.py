"""A sample's per-token arrays on the control channel (`workers.protocol.arrays`): packed int32 / uint8 / float64
buffers that round-trip bit-exactly, are refused with a clear error when malformed, stay views of the received
frame on the rank and become the trainer's tensors with the same values the lists gave."""

from __future__ import annotations

import math
import struct
import tracemalloc

import msgspec
import numpy as np
import pytest
import torch
from msgspec.msgpack import Ext

from replay.sample import Sample
from workers import protocol
from workers.protocol.arrays import Kind, PackedArray
from workers.train_rank.batching import BatchError, check_sample
from workers.train_rank.packing import pack

SPECIAL = [-0.0, 5e-324, -1e-310, -(2.0**-30) / 3, -1 / 3, float("-inf"), float("nan"), -1e300]


def request(*samples: protocol.WireSample) -> protocol.Request:
    return protocol.Request(1, protocol.TrainCommand(7, [list(samples)], [3]))


def roundtrip(message: protocol.Request) -> protocol.Request:
    frame = protocol.encode_frame(message)
    decoded = protocol.decode_body(bytearray(frame[4:]))  # the rank decodes the buffer it received into
    assert isinstance(decoded, protocol.Request)
    return decoded


def floats_bits(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def test_every_field_round_trips_bit_exactly_and_optional_fields_stay_absent() -> None:
    logprobs = [*SPECIAL, -0.1, -2.5]
    full = protocol.WireSample(tokens=[0, 1, 151_935, 2**31 - 1, *range(len(logprobs))],
                               response_length=len(logprobs), loss_mask=[1, 0] * (len(logprobs) // 2),
                               rollout_log_probs=logprobs, advantage=-0.75, teacher_log_probs=logprobs[::-1],
                               opd_reverse_kl=[0.5] * len(logprobs))
    bare = protocol.WireSample(tokens=[3, 4], response_length=0, loss_mask=[], rollout_log_probs=[])
    got_full, got_bare = roundtrip(request(full, bare)).command.steps[0]
    assert got_full == full and got_bare == bare  # bit-equal buffers (a NaN equals itself, -0.0 is not 0.0)
    assert got_full.tokens.tolist() == [0, 1, 151_935, 2**31 - 1, *range(len(logprobs))]
    assert got_full.loss_mask.tolist() == [1, 0] * (len(logprobs) // 2)
    assert bytes(got_full.rollout_log_probs.packed()) == floats_bits(logprobs)
    assert bytes(got_full.teacher_log_probs.packed()) == floats_bits(logprobs[::-1])  # type: ignore[union-attr]
    assert got_full.opd_reverse_kl == [0.5] * len(logprobs) and got_full.advantage == -0.75
    assert got_bare.teacher_log_probs is None and got_bare.opd_reverse_kl is None and len(got_bare.loss_mask) == 0


def test_the_rank_keeps_views_of_the_frame_and_the_coordinator_no_copy_of_the_sample() -> None:
    sample = Sample(prompt="", tokens=list(range(100_000)), response_length=90_000, loss_mask=[1] * 90_000,
                    rollout_log_probs=[-0.5] * 90_000)
    tracemalloc.start()
    try:
        wire = protocol.WireSample.from_sample(sample)
        built, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert built < 10_000  # references to the sample's lists; the 0.8 MB of values are packed as the frame is
    body = bytearray(protocol.encode_frame(request(wire))[4:])
    decoded = protocol.decode_body(body).command.steps[0][0]  # type: ignore[attr-defined]
    for array in (decoded.tokens, decoded.loss_mask, decoded.rollout_log_probs):
        assert array.packed().obj is body  # a view of the received buffer, not a copy of it
    assert decoded.tokens == sample.tokens


def test_a_hooks_numpy_arrays_and_tensors_pack_to_the_lists_bytes() -> None:
    tokens, mask, logprobs = [5, 6, 70_000, 8], [1, 0], [-0.5, -1 / 3]
    from_lists = protocol.WireSample(tokens=tokens, response_length=2, loss_mask=mask, rollout_log_probs=logprobs)
    for convert in (np.asarray, lambda values: torch.from_numpy(np.asarray(values))):  # int64, bool, float64
        hooked = protocol.WireSample(tokens=convert(tokens), response_length=2,
                                     loss_mask=convert([True, False]), rollout_log_probs=convert(logprobs))
        assert roundtrip(request(hooked)) == roundtrip(request(from_lists))
    floats_for_ints = protocol.WireSample(tokens=np.asarray([5.0, 6.9, 70_000.0, 8.0]), response_length=2,
                                          loss_mask=[1.0, 0.0], rollout_log_probs=logprobs)
    assert roundtrip(request(floats_for_ints)).command.steps[0][0].tokens == [5, 6, 70_000, 8]  # int(), as before


def body_with(**fields: object) -> bytes:
    sample = {"tokens": Ext(2, struct.pack("<3i", 4, 5, 6)), "response_length": 1, "loss_mask": Ext(3, b"\x01"),
              "rollout_log_probs": Ext(4, struct.pack("<d", -0.5)), **fields}
    return msgspec.msgpack.encode({"kind": "request", "request_id": 1, "command": {
        "kind": "train", "rollout_id": 0, "steps": [[sample]], "step_loss_tokens": [1]}})


@pytest.mark.parametrize(("fields", "error"), [
    ({"tokens": Ext(2, b"\x01\x00\x00\x00\x02\x00")}, "tokens array of 6 bytes is not a whole number of 4-byte"),
    ({"rollout_log_probs": Ext(4, b"\x00" * 12)}, "floats array of 12 bytes is not a whole number of 8-byte"),
    ({"response_length": 2}, r"loss_mask has 1 entries, response_length is 2 - at `\$.command.steps\[0\]\[0\]`"),
    ({"rollout_log_probs": Ext(4, b"")}, "rollout_log_probs has 0 entries, response_length is 1"),
    ({"tokens": Ext(2, struct.pack("<2i", 5, -3))}, "token id -3 is negative"),
    ({"loss_mask": Ext(4, struct.pack("<d", 1.0))}, "a floats array where mask belongs"),
    ({"tokens": [4, 5, 6]}, r"Expected `PackedArray`, got `list` - at `\$.command.steps\[0\]\[0\].tokens`"),
    ({"tokens": Ext(9, b"")}, "unknown msgpack ext type 9"),
])
def test_malformed_buffers_are_refused_with_a_clear_error(fields: dict[str, object], error: str) -> None:
    assert isinstance(protocol.decode_body(body_with()), protocol.Request)  # the unaltered body decodes
    with pytest.raises(protocol.ProtocolError, match=error):
        protocol.decode_body(body_with(**fields))


@pytest.mark.parametrize(("fields", "error"), [
    ({"tokens": [1, 2**31, 3]}, r"tokens: values outside -2147483648\.\.2147483647"),
    ({"tokens": [1, -2, 3]}, "token id -2 is negative"),
    ({"tokens": np.asarray([1, 2**40, 3])}, r"tokens: values outside"),
    ({"loss_mask": [256]}, r"mask: values outside 0\.\.255"),
    ({"loss_mask": [-1]}, r"mask: values outside 0\.\.255"),
    ({"rollout_log_probs": ["x"]}, "floats: could not convert string to float"),
])
def test_the_coordinator_refuses_values_its_arrays_cannot_hold(fields: dict[str, object], error: str) -> None:
    sample = protocol.WireSample(**{"tokens": [1, 2, 3], "response_length": 1, "loss_mask": [1],  # type: ignore[arg-type]
                                    "rollout_log_probs": [-0.5], **fields})
    with pytest.raises(protocol.ProtocolError, match=error):  # before any byte is sent
        protocol.encode_frame(request(sample))


def test_lengths_are_checked_when_a_sample_is_built() -> None:
    with pytest.raises(ValueError, match="rollout_log_probs has 2 entries, response_length is 1"):
        protocol.WireSample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_log_probs=[0.0, 0.0])
    with pytest.raises(ValueError, match="a tokens array where mask belongs"):
        protocol.WireSample(tokens=[1, 2], response_length=1, loss_mask=PackedArray.of(Kind.TOKENS, [1]),
                            rollout_log_probs=[0.0])


def test_the_rank_tensors_equal_what_the_lists_gave() -> None:
    rng = np.random.default_rng(0)
    logprobs = [*(-rng.random(50) * 7).tolist(), float("nan")]  # a tool token's NaN: masked, zeroed
    mask = [1] * 50 + [0]
    tokens = rng.integers(0, 151_936, 60).tolist()
    wire = roundtrip(request(protocol.WireSample(tokens=tokens, response_length=51, loss_mask=mask,
                                                 rollout_log_probs=logprobs))).command.steps[0][0]
    batch = pack([wire], pad_token_id=0)
    assert torch.equal(batch.input_ids[0], torch.tensor(tokens, dtype=torch.long))
    start = 60 - 51 - 1
    expected = torch.tensor([value if keep else 0.0 for value, keep in zip(logprobs, mask, strict=True)],
                            dtype=torch.float32)  # the old path: floats rounded to float32 by torch
    assert torch.equal(batch.rollout_log_probs[0, start:start + 51], expected)
    assert torch.equal(batch.loss_mask[0, start:start + 51], torch.tensor(mask, dtype=torch.float32))


def test_a_trained_tokens_non_finite_logprob_is_refused_on_the_rank() -> None:
    for bad in (float("nan"), float("inf")):
        sample = protocol.WireSample(tokens=[1, 2, 3], response_length=2, loss_mask=[0, 1],
                                     rollout_log_probs=[0.0, bad])
        with pytest.raises(BatchError, match="sample 4: a trained token's rollout logprob is not finite"):
            check_sample(sample, 4)
    masked = protocol.WireSample(tokens=[1, 2, 3], response_length=2, loss_mask=[0, 1],
                                 rollout_log_probs=[float("-inf"), -0.5])
    check_sample(masked, 0)  # a tool token's -inf is not trained on: accepted (and zeroed by `pack`)
    assert math.isinf(masked.rollout_log_probs[0])


@pytest.mark.parametrize("count", [0, 1, 15, 16, 65_535, 65_536])
def test_float_lists_of_every_length_pack_bit_exactly(count: int) -> None:
    # each msgpack array header size (fixarray, array 16, array 32), and lists msgspec writes otherwise
    values = (-np.random.default_rng(count).random(count) * 9).tolist()
    for listed in (values, [*values[:-1], -1] if count else [], [*values, True], [*values, np.float64(-0.25)]):
        packed = PackedArray.of(Kind.FLOATS, listed).packed()
        assert bytes(packed) == floats_bits([float(value) for value in listed])
